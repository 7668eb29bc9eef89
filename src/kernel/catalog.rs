//! The tool catalog as the kernel sees it: names, read or write, idempotency, which result
//! fields may become facts, an argument schema checked before any call, and where the tool
//! lives (an HTTP URL, or an MCP server with the definition it had when the task was
//! enqueued). Pure data and checks; the tools themselves live outside the kernel.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    pub access: Access,
    /// The service replays a stored result for a repeated call key, so a write whose outcome
    /// is unknown after a crash may be retried under the same key.
    #[serde(default)]
    pub idempotent: bool,
    /// Result fields copied into facts (an allow-list); anything else in a result is content.
    #[serde(default)]
    pub fact_fields: Vec<String>,
    /// The argument whose value prefixes fact names (`ord_1001.total_cents`).
    #[serde(default)]
    pub fact_prefix_arg: String,
    /// Phrases for the closing message: what was done, and what was not.
    #[serde(default)]
    pub done_phrase: String,
    #[serde(default)]
    pub not_done_phrase: String,
    /// Argument schema; empty means arguments are not checked here (the document's store
    /// checks its own). Unknown arguments are refused when a schema is given.
    #[serde(default)]
    pub args: BTreeMap<String, ArgSpec>,
    /// Where an HTTP tool lives; `None` for the built-in demo store.
    #[serde(default)]
    pub http: Option<HttpSpec>,
    /// Where an MCP tool lives, and its definition as it was at enqueue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<McpSpec>,
}

/// An MCP server's tool, as a task's snapshot keeps it (taken at enqueue).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpSpec {
    /// The server's name in the worker's config (`[mcp.servers.NAME]`).
    pub server: String,
    /// The digest of the server's definition at enqueue; a call is refused if it changed.
    pub digest: String,
    /// The tool's `inputSchema` (JSON Schema), checked before anything is sent.
    pub input_schema: Value,
    /// The worker sends a call only under an operator's approval of its exact arguments.
    #[serde(default)]
    pub needs_approval: bool,
    /// The argument that receives the task's user id; the model may not set it.
    #[serde(default)]
    pub user_arg: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgType {
    String,
    Integer,
    Number,
    Boolean,
}

/// One argument: its type, whether it is required, and bounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgSpec {
    #[serde(rename = "type")]
    pub kind: ArgType,
    #[serde(default)]
    pub required: bool,
    /// Numbers: inclusive bounds.
    #[serde(default)]
    pub min: Option<f64>,
    #[serde(default)]
    pub max: Option<f64>,
    /// Strings: longest length in characters.
    #[serde(default)]
    pub max_len: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSpec {
    #[serde(default = "default_method")]
    pub method: String,
    pub url: String,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Answers whether a call key was applied: `GET {lookup_url}?key=K`.
    #[serde(default)]
    pub lookup_url: Option<String>,
    /// The environment variable (of the daemon) holding this service's approval secret: an
    /// approved call is re-sent with a `Tether-Approval` header signed with it, which the
    /// service verifies. Without one, an approved call is not sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_secret_env: Option<String>,
}

fn default_method() -> String {
    "POST".into()
}

fn default_timeout_ms() -> u64 {
    10_000
}

/// The arguments a call sends: the model's, plus the task's user id under an MCP tool's
/// `user_arg`.
pub fn args_as_sent(
    spec: &ToolSpec,
    args: &Map<String, Value>,
    user_id: &str,
) -> Map<String, Value> {
    let mut sent = args.clone();
    if let Some(u) = spec.mcp.as_ref().and_then(|m| m.user_arg.as_deref()) {
        sent.insert(u.to_string(), Value::String(user_id.to_string()));
    }
    sent
}

/// Checks an MCP tool's arguments, as they will be sent, against its `inputSchema`.
fn check_mcp_args(
    spec: &ToolSpec,
    m: &McpSpec,
    args: &Map<String, Value>,
    user_id: &str,
) -> Result<(), String> {
    if let Some(u) = m.user_arg.as_deref()
        && args.contains_key(u)
    {
        return Err(format!(
            "{}: argument {u:?} is the task's user id; it comes from the task, not the model",
            spec.name
        ));
    }
    let validator = jsonschema::validator_for(&m.input_schema).map_err(|e| {
        format!(
            "{}: the server's input schema cannot be used to check arguments: {e}",
            spec.name
        )
    })?;
    let sent = Value::Object(args_as_sent(spec, args, user_id));
    let problems: Vec<String> = validator
        .iter_errors(&sent)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {}", spec.name, problems.join("; ")))
    }
}

/// Checks arguments against a tool's schema (the catalog's own, or an MCP tool's
/// `inputSchema`). `Err` names the first problems.
pub fn check_args(spec: &ToolSpec, args: &Map<String, Value>, user_id: &str) -> Result<(), String> {
    if let Some(m) = &spec.mcp {
        return check_mcp_args(spec, m, args, user_id);
    }
    if spec.args.is_empty() {
        return Ok(());
    }
    for (name, a) in &spec.args {
        let Some(v) = args.get(name) else {
            if a.required {
                return Err(format!("{}: missing required argument {name:?}", spec.name));
            }
            continue;
        };
        let ok_type = match a.kind {
            ArgType::String => v.is_string(),
            ArgType::Integer => v.is_i64() || v.is_u64(),
            ArgType::Number => v.is_number(),
            ArgType::Boolean => v.is_boolean(),
        };
        if !ok_type {
            return Err(format!(
                "{}: argument {name:?} must be of type {:?}",
                spec.name, a.kind
            )
            .to_lowercase());
        }
        if let Some(x) = v.as_f64()
            && (a.min.is_some_and(|m| x < m) || a.max.is_some_and(|m| x > m))
        {
            return Err(format!(
                "{}: argument {name:?} = {x} is outside [{}, {}]",
                spec.name,
                a.min.map_or("-inf".into(), |m| m.to_string()),
                a.max.map_or("inf".into(), |m| m.to_string())
            ));
        }
        if let (Some(s), Some(max)) = (v.as_str(), a.max_len)
            && s.chars().count() > max
        {
            return Err(format!(
                "{}: argument {name:?} is longer than {max} characters",
                spec.name
            ));
        }
    }
    if let Some(extra) = args.keys().find(|k| !spec.args.contains_key(*k)) {
        return Err(format!("{}: unknown argument {extra:?}", spec.name));
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Catalog {
    pub tools: Vec<ToolSpec>,
}

impl Catalog {
    pub fn get(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The document's store: two reads and two writes. Refunds are money, so a refund whose
    /// outcome is unknown is held for reconcile; a status email is safe to retry by key.
    pub fn demo() -> Catalog {
        let spec = |name: &str, access, idempotent, fields: &[&str], done: &str, not_done: &str| {
            ToolSpec {
                name: name.to_string(),
                access,
                idempotent,
                fact_fields: fields.iter().map(|f| f.to_string()).collect(),
                fact_prefix_arg: "order_id".to_string(),
                done_phrase: done.to_string(),
                not_done_phrase: not_done.to_string(),
                args: BTreeMap::new(),
                http: None,
                mcp: None,
            }
        };
        Catalog {
            tools: vec![
                spec(
                    "get_order",
                    Access::Read,
                    true,
                    &["order_status", "total_cents", "refunded_cents"],
                    "the order was read",
                    "the order was not read",
                ),
                spec(
                    "search_policy",
                    Access::Read,
                    true,
                    &[],
                    "the policy was looked up",
                    "the policy was not looked up",
                ),
                spec(
                    "issue_refund",
                    Access::Write,
                    false,
                    &["refunded_cents"],
                    "the refund was issued",
                    "the refund was not issued",
                ),
                spec(
                    "send_status_email",
                    Access::Write,
                    true,
                    &["sent"],
                    "the confirmation email was sent",
                    "the confirmation email was not sent",
                ),
            ],
        }
    }
}
