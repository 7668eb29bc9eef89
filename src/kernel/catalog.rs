//! The tool catalog as the kernel sees it: names, read or write, idempotency, which result
//! fields may become facts, an argument schema checked before any call, and where the tool
//! lives (an HTTP URL, or an MCP server with the definition it had when the task was
//! enqueued). Pure data and checks; the tools themselves live outside the kernel.

use serde::{Deserialize, Serialize};

pub use super::policy::{Approval, Requires, RetryPolicy};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
}

/// Where a tool's calls go: one of three routes, named exhaustively, so a new route cannot be
/// forgotten by a match.
#[derive(Clone, Copy, Debug)]
pub enum Route<'a> {
    /// The demo shop (`tools::durable`), the design reference's example service.
    Demo,
    Http(&'a HttpSpec),
    Mcp(&'a McpSpec),
    /// A question to a person (`ask_person`): the kernel holds it, nothing is sent.
    Person,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    /// What the tool does and when to use it, for the model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
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
    /// When a call needs an operator's approval of its exact arguments before the worker
    /// sends it (on any route).
    #[serde(default, skip_serializing_if = "Approval::is_never")]
    pub approval: Approval,
    /// What a plan step of this tool must come after.
    #[serde(default, skip_serializing_if = "Requires::is_nothing")]
    pub requires: Requires,
    /// Argument schema; empty means arguments are not checked here (the demo shop
    /// checks its own). Unknown arguments are refused when a schema is given.
    #[serde(default)]
    pub args: BTreeMap<String, ArgSpec>,
    /// Where an HTTP tool lives; `None` for the built-in demo store.
    #[serde(default)]
    pub http: Option<HttpSpec>,
    /// Where an MCP tool lives, and its definition as it was at enqueue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<McpSpec>,
    /// The built-in question to a person (`super::person`): answered by a person, never sent.
    #[serde(default, skip_serializing_if = "is_false")]
    pub asks_person: bool,
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
    Array,
    Object,
}

impl ArgType {
    fn as_str(self) -> &'static str {
        match self {
            ArgType::String => "string",
            ArgType::Integer => "integer",
            ArgType::Number => "number",
            ArgType::Boolean => "boolean",
            ArgType::Array => "array",
            ArgType::Object => "object",
        }
    }
}

/// One argument (or an item or property of one): a subset of JSON Schema written as TOML, so
/// that the schema the model is shown is the schema the kernel checks (see `docs/catalog.md`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArgSpec {
    #[serde(rename = "type")]
    pub kind: ArgType,
    /// What the argument means, for the model.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, skip_serializing_if = "is_false")]
    pub required: bool,
    /// The only values allowed.
    #[serde(default, rename = "enum", skip_serializing_if = "Option::is_none")]
    pub allowed: Option<Vec<Value>>,
    /// Numbers: inclusive bounds.
    #[serde(default, alias = "minimum", skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, alias = "maximum", skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
    /// Strings: length bounds in characters, and a regular expression the value must match.
    #[serde(default, alias = "minLength", skip_serializing_if = "Option::is_none")]
    pub min_len: Option<u64>,
    #[serde(default, alias = "maxLength", skip_serializing_if = "Option::is_none")]
    pub max_len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Arrays: the schema of every item, and bounds on how many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Box<ArgSpec>>,
    #[serde(default, alias = "minItems", skip_serializing_if = "Option::is_none")]
    pub min_items: Option<u64>,
    #[serde(default, alias = "maxItems", skip_serializing_if = "Option::is_none")]
    pub max_items: Option<u64>,
    /// Objects: their properties (any other property is refused).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, ArgSpec>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl ArgSpec {
    /// This argument as JSON Schema.
    pub fn to_schema(&self) -> Value {
        let mut m = Map::new();
        m.insert("type".into(), Value::from(self.kind.as_str()));
        if !self.description.is_empty() {
            m.insert("description".into(), Value::from(self.description.clone()));
        }
        if let Some(a) = &self.allowed {
            m.insert("enum".into(), Value::Array(a.clone()));
        }
        let mut num = |k: &str, v: Option<f64>| {
            if let Some(x) = v {
                // Whole bounds are written as integers, as a person would write them.
                let n = if x.fract() == 0.0 && x.abs() < 9.0e15 {
                    Value::from(x as i64)
                } else {
                    Value::from(x)
                };
                m.insert(k.into(), n);
            }
        };
        num("minimum", self.min);
        num("maximum", self.max);
        for (k, v) in [
            ("minLength", self.min_len),
            ("maxLength", self.max_len),
            ("minItems", self.min_items),
            ("maxItems", self.max_items),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), Value::from(v));
            }
        }
        if let Some(p) = &self.pattern {
            m.insert("pattern".into(), Value::from(p.clone()));
        }
        if let Some(i) = &self.items {
            m.insert("items".into(), i.to_schema());
        }
        if self.kind == ArgType::Object {
            let (props, required) = object_parts(&self.properties);
            m.insert("properties".into(), props);
            if !required.is_empty() {
                m.insert("required".into(), Value::Array(required));
            }
            m.insert("additionalProperties".into(), Value::Bool(false));
        }
        Value::Object(m)
    }

    /// What in this argument's declaration cannot work (a keyword for another type, an enum
    /// value of the wrong type, a pattern that is not a regular expression), at `at`.
    fn check(&self, at: &str) -> Result<(), String> {
        let t = self.kind;
        let only = |what: &str, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "{at}: {what} does not apply to type {}",
                    t.as_str()
                ))
            }
        };
        let number = matches!(t, ArgType::Integer | ArgType::Number);
        only(
            "min/max",
            number || (self.min.is_none() && self.max.is_none()),
        )?;
        only(
            "min_len/max_len/pattern",
            t == ArgType::String
                || (self.min_len.is_none() && self.max_len.is_none() && self.pattern.is_none()),
        )?;
        only(
            "items/min_items/max_items",
            t == ArgType::Array
                || (self.items.is_none() && self.min_items.is_none() && self.max_items.is_none()),
        )?;
        only(
            "properties",
            t == ArgType::Object || self.properties.is_empty(),
        )?;
        if t == ArgType::Array && self.items.is_none() {
            return Err(format!(
                "{at}: an array needs `items` (the schema of each item)"
            ));
        }
        if let (Some(lo), Some(hi)) = (self.min, self.max)
            && lo > hi
        {
            return Err(format!("{at}: min {lo} is above max {hi}"));
        }
        if let Some(values) = &self.allowed {
            if values.is_empty() {
                return Err(format!("{at}: enum lists no values"));
            }
            let schema = ArgSpec {
                allowed: None,
                ..self.clone()
            }
            .to_schema();
            let v = jsonschema::validator_for(&schema).map_err(|e| format!("{at}: {e}"))?;
            if let Some(bad) = values.iter().find(|x| !v.is_valid(x)) {
                return Err(format!(
                    "{at}: enum value {bad} is not a valid {}",
                    t.as_str()
                ));
            }
        }
        if let Some(p) = &self.pattern {
            jsonschema::validator_for(&serde_json::json!({"type": "string", "pattern": p}))
                .map_err(|e| format!("{at}: pattern {p:?} is not a regular expression: {e}"))?;
        }
        if let Some(i) = &self.items {
            i.check(&format!("{at}.items"))?;
        }
        for (n, p) in &self.properties {
            p.check(&format!("{at}.properties.{n}"))?;
        }
        Ok(())
    }
}

/// The `properties` and `required` of an object schema with these arguments.
fn object_parts(args: &BTreeMap<String, ArgSpec>) -> (Value, Vec<Value>) {
    let props: Map<String, Value> = args
        .iter()
        .map(|(n, a)| (n.clone(), a.to_schema()))
        .collect();
    let required = args
        .iter()
        .filter(|(_, a)| a.required)
        .map(|(n, _)| Value::from(n.clone()))
        .collect();
    (Value::Object(props), required)
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
    /// Whether the daemon settles a held write of this tool by asking `lookup_url` itself
    /// (on by default; off leaves every held write to an operator).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub auto_settle: bool,
    /// How long after a held write was sent the daemon waits before it believes a lookup's
    /// `applied: false` (a slow service may still be doing the work); `applied: true` is
    /// believed once the send's own timeout has passed.
    #[serde(
        default = "default_lookup_grace_ms",
        skip_serializing_if = "is_default_grace"
    )]
    pub lookup_grace_ms: u64,
    /// The environment variable (of the daemon) holding this service's approval secret: an
    /// approved call is re-sent with a `Tether-Approval` header signed with it, which the
    /// service verifies. Without one, an approved call is not sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_secret_env: Option<String>,
    /// How a transient failure (408, 409, 425, 429, 5xx, no connection, a timeout) is tried
    /// again, for a read or an idempotent write: see [`RetryPolicy`].
    #[serde(default, skip_serializing_if = "RetryPolicy::is_default")]
    pub retry: RetryPolicy,
    /// A tool made from an OpenAPI operation: how its request is built from the arguments
    /// (`url` is then the API's base URL). Set by the catalog's `[[openapi]]` sources only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<super::api::ApiCall>,
}

fn default_lookup_grace_ms() -> u64 {
    60_000
}

fn is_default_grace(ms: &u64) -> bool {
    *ms == default_lookup_grace_ms()
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
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
    let sent = Value::Object(args_as_sent(spec, args, user_id));
    validate(&spec.name, &m.input_schema, &sent)
}

/// Checks arguments against a tool's schema (the catalog's own, or an MCP tool's
/// `inputSchema`). `Err` names the first problems.
pub fn check_args(spec: &ToolSpec, args: &Map<String, Value>, user_id: &str) -> Result<(), String> {
    if let Some(m) = &spec.mcp {
        return check_mcp_args(spec, m, args, user_id);
    }
    if let Some(api) = spec.http.as_ref().and_then(|h| h.api.as_ref()) {
        return validate(&spec.name, &api.schema, &Value::Object(args.clone()));
    }
    if spec.args.is_empty() {
        return Ok(());
    }
    validate(
        &spec.name,
        &spec.input_schema(),
        &Value::Object(args.clone()),
    )
}

/// Up to three problems of `instance` against `schema`, each with where it is.
fn validate(tool: &str, schema: &Value, instance: &Value) -> Result<(), String> {
    let validator = jsonschema::validator_for(schema)
        .map_err(|e| format!("{tool}: the input schema cannot be used to check arguments: {e}"))?;
    let problems = schema_errors(&validator, instance);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("{tool}: {}", problems.join("; ")))
    }
}

impl ToolSpec {
    /// The route of this tool's calls: MCP or HTTP when it names one, else the demo shop.
    pub fn route(&self) -> Route<'_> {
        match (&self.mcp, &self.http) {
            _ if self.asks_person => Route::Person,
            (Some(m), _) => Route::Mcp(m),
            (None, Some(h)) => Route::Http(h),
            (None, None) => Route::Demo,
        }
    }

    /// The tool's arguments as JSON Schema: an MCP tool's `inputSchema` as its server gave it;
    /// a catalog tool's schema from its `args` (any object, when it declares none).
    pub fn input_schema(&self) -> Value {
        if let Some(m) = &self.mcp {
            return m.input_schema.clone();
        }
        if let Some(api) = self.http.as_ref().and_then(|h| h.api.as_ref()) {
            return api.schema.clone();
        }
        if self.args.is_empty() {
            return serde_json::json!({"type": "object"});
        }
        let (props, required) = object_parts(&self.args);
        let mut m = Map::new();
        m.insert("type".into(), Value::from("object"));
        m.insert("properties".into(), props);
        if !required.is_empty() {
            m.insert("required".into(), Value::Array(required));
        }
        m.insert("additionalProperties".into(), Value::Bool(false));
        Value::Object(m)
    }

    /// What in this tool's argument declarations cannot work; `Ok` when they all can.
    pub fn check_schema(&self) -> Result<(), String> {
        for (n, a) in &self.args {
            a.check(&format!("args.{n}"))?;
        }
        jsonschema::validator_for(&self.input_schema())
            .map(|_| ())
            .map_err(|e| format!("the argument schema cannot be used: {e}"))
    }
}

#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Catalog {
    pub tools: Vec<ToolSpec>,
}

impl Catalog {
    pub fn get(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The demo shop: two reads and two writes. Refunds are money, so a refund whose
    /// outcome is unknown is held for reconcile; a status email is safe to retry by key.
    pub fn demo() -> Catalog {
        let spec = |name: &str, access, idempotent, fields: &[&str], done: &str, not_done: &str| {
            ToolSpec {
                name: name.to_string(),
                description: String::new(),
                access,
                idempotent,
                fact_fields: fields.iter().map(|f| f.to_string()).collect(),
                fact_prefix_arg: "order_id".to_string(),
                done_phrase: done.to_string(),
                not_done_phrase: not_done.to_string(),
                approval: Approval::Never,
                // The design reference's rule for its store: a write has a prerequisite.
                requires: if access == Access::Write {
                    Requires::AnyStep
                } else {
                    Requires::Nothing
                },
                args: BTreeMap::new(),
                http: None,
                mcp: None,
                asks_person: false,
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

/// The first three ways `instance` breaks the schema of `validator`, each prefixed with where
/// (its JSON pointer) unless it is the whole value.
pub fn schema_errors(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator
        .iter_errors(instance)
        .take(3)
        .map(|e| {
            let at = e.instance_path().to_string();
            if at.is_empty() {
                e.to_string()
            } else {
                format!("{at}: {e}")
            }
        })
        .collect()
}
