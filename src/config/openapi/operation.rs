//! One operation of an OpenAPI document made into a tool: its flat argument schema (the
//! path, query and header parameters and the JSON body's properties), where each argument
//! goes, and the catalog options over it.

use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

use super::Overrides;
use super::schema::resolve;
use crate::kernel::ToolSpec;
use crate::kernel::api::{ApiAuth, ApiBody, ApiCall, ApiParam, Place};
use crate::kernel::catalog::{Access, HttpSpec};

/// Headers a tool's model never sets: the worker's (auth, the call key, the approval, the
/// body's type) and those that frame the request or the connection.
const WORKER_HEADERS: [&str; 14] = [
    "authorization",
    "idempotency-key",
    "tether-approval",
    "content-type",
    "accept",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
];

/// The names between braces in a path template (`/a/{id}/b/{x}`: `id`, `x`).
fn placeholders(path: &str) -> Vec<&str> {
    path.split('{')
        .skip(1)
        .filter_map(|rest| rest.split_once('}').map(|(name, _)| name))
        .collect()
}

/// One operation of the document, being made into a tool.
pub(super) struct Operation<'a> {
    pub(super) doc: &'a Value,
    pub(super) item: &'a Value,
    pub(super) op: &'a Value,
    pub(super) method: &'a str,
    pub(super) path: &'a str,
    pub(super) auth: &'a [ApiAuth],
}

/// The flat argument object of a tool being built.
#[derive(Default)]
struct Args {
    props: Map<String, Value>,
    required: Vec<Value>,
}

impl Args {
    fn add(&mut self, name: &str, schema: Value, required: bool) -> Result<(), String> {
        if self.props.contains_key(name) {
            return Err(format!("two of its parameters are called {name:?}"));
        }
        if name == crate::model::prompt::PLAN_STEP_ARG {
            return Err(format!(
                "a parameter is called {name:?}, the kernel's own argument (the plan step a call carries out)"
            ));
        }
        self.props.insert(name.to_string(), schema);
        if required {
            self.required.push(Value::from(name));
        }
        Ok(())
    }
}

impl Operation<'_> {
    pub(super) fn tool(
        &mut self,
        name: &str,
        base: &str,
        o: Option<&Overrides>,
    ) -> Result<ToolSpec, String> {
        let default = Overrides::default();
        let o = o.unwrap_or(&default);
        let mut args = Args::default();
        let params = self.params(&mut args)?;
        let body = self.body(&mut args)?;
        let schema = json!({
            "type": "object",
            "properties": args.props,
            "required": args.required,
            "additionalProperties": false,
        });
        jsonschema::validator_for(&schema)
            .map_err(|e| format!("its argument schema cannot be used: {e}"))?;
        // The catalog is stored with each task, the schema five levels down in it.
        let depth = crate::limits::json_depth(&schema);
        if depth + 5 > crate::limits::JSON_DEPTH_MAX {
            return Err(format!(
                "its argument schema nests {depth} levels of objects and arrays once its $refs are written out; a task can store at most {}",
                crate::limits::JSON_DEPTH_MAX - 5
            ));
        }
        let read = matches!(self.method, "get" | "head");
        let mut http: HttpSpec =
            serde_json::from_value(json!({"url": base, "method": self.method.to_uppercase()}))
                .map_err(|e| e.to_string())?;
        http.timeout_ms = o.timeout_ms.unwrap_or(http.timeout_ms);
        http.lookup_url = o.lookup_url.clone();
        http.auto_settle = o.auto_settle.unwrap_or(http.auto_settle);
        http.lookup_grace_ms = o.lookup_grace_ms.unwrap_or(http.lookup_grace_ms);
        http.approval_secret_env = o.approval_secret_env.clone();
        http.retry = o.retry.unwrap_or_default();
        http.api = Some(ApiCall {
            operation: self.op["operationId"]
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| format!("{} {}", self.method.to_uppercase(), self.path)),
            path: self.path.to_string(),
            schema,
            params,
            body,
            auth: self.auth.to_vec(),
        });
        Ok(ToolSpec {
            name: name.to_string(),
            description: o.description.clone().unwrap_or_else(|| self.description()),
            access: o
                .access
                .unwrap_or(if read { Access::Read } else { Access::Write }),
            idempotent: o
                .idempotent
                .unwrap_or(matches!(self.method, "get" | "head" | "put" | "delete")),
            fact_fields: o.fact_fields.clone(),
            fact_prefix_arg: o.fact_prefix_arg.clone(),
            done_phrase: o.done_phrase.clone(),
            not_done_phrase: o.not_done_phrase.clone(),
            approval: o.approval.clone(),
            requires: o.requires.clone(),
            args: BTreeMap::new(),
            http: Some(http),
            mcp: None,
            asks_person: false,
        })
    }

    /// The summary and the description, as the model is told what the tool does.
    fn description(&self) -> String {
        let words: Vec<&str> = ["summary", "description"]
            .iter()
            .filter_map(|k| {
                self.op[*k]
                    .as_str()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
            })
            .collect();
        let text = words.join("\n");
        text.chars().take(1024).collect()
    }

    /// The path, query and header parameters (the path item's, then the operation's, which
    /// replace one of the same name and place), added to `args`.
    fn params(&self, args: &mut Args) -> Result<Vec<ApiParam>, String> {
        let mut all: Vec<Value> = Vec::new();
        for list in [&self.item["parameters"], &self.op["parameters"]] {
            for p in list.as_array().into_iter().flatten() {
                let p = resolve(self.doc, p)?;
                all.retain(|q| !(q["name"] == p["name"] && q["in"] == p["in"]));
                all.push(p);
            }
        }
        let mut out = Vec::new();
        for p in &all {
            let name = p["name"].as_str().ok_or("a parameter has no name")?;
            let required = p["required"] == true || p["in"] == "path";
            let place = match p["in"].as_str() {
                Some("path") => Place::Path,
                Some("query") => Place::Query,
                Some("header") => Place::Header,
                Some("cookie") if !required => continue,
                other => {
                    return Err(format!(
                        "parameter {name:?} is in {}, which a tool cannot set",
                        other.map_or("no place".into(), |o| format!("{o:?}"))
                    ));
                }
            };
            if place == Place::Header && !self.offers_header(name, required)? {
                continue;
            }
            let mut schema = match p.get("schema") {
                Some(s) => s.clone(),
                None if !required => continue,
                None => {
                    return Err(format!(
                        "parameter {name:?} has no schema (a `content` parameter), which a tool cannot fill"
                    ));
                }
            };
            if let (Some(d), Some(s)) = (p["description"].as_str(), schema.as_object_mut()) {
                s.entry("description").or_insert_with(|| Value::from(d));
            }
            if place == Place::Path
                && let Some(s) = schema.as_object_mut()
            {
                // A path value is one segment: never empty, never `.` or `..`.
                s.insert("minLength".into(), json!(1));
                s.insert("not".into(), json!({"enum": [".", ".."]}));
            }
            if place == Place::Path && !placeholders(self.path).contains(&name) {
                return Err(format!("the path has no {{{name}}} for its path parameter"));
            }
            args.add(name, schema, required)?;
            out.push(ApiParam {
                arg: name.to_string(),
                name: name.to_string(),
                place,
            });
        }
        if !self.path.starts_with('/') {
            return Err("the path does not start with '/'".into());
        }
        for x in placeholders(self.path) {
            if !out.iter().any(|p| p.place == Place::Path && p.name == x) {
                return Err(format!(
                    "the path's {{{x}}} is no path parameter of the operation"
                ));
            }
        }
        Ok(out)
    }

    /// Whether a header parameter is offered to the model: not one the worker sets (the
    /// API's auth, the call key, the approval, the body's framing, the connection's), and a
    /// valid header name. A required one the worker sets is an error.
    fn offers_header(&self, name: &str, required: bool) -> Result<bool, String> {
        let lower = name.to_ascii_lowercase();
        let auth = self
            .auth
            .iter()
            .any(|a| a.header.eq_ignore_ascii_case(name));
        if auth {
            return Ok(false);
        }
        if WORKER_HEADERS.contains(&lower.as_str()) || lower.starts_with("proxy-") {
            if required {
                return Err(format!(
                    "the header {name:?} is set by the worker or the connection, never by the model (an API's key or token: bearer_env or api_key_env)"
                ));
            }
            return Ok(false);
        }
        http::HeaderName::from_bytes(name.as_bytes())
            .map(|_| true)
            .map_err(|_| format!("the header parameter {name:?} is not a header name"))
    }

    /// The JSON request body: an object's properties as arguments of their own, or the
    /// whole body as the argument `body`.
    fn body(&self, args: &mut Args) -> Result<ApiBody, String> {
        let Some(rb) = self.op.get("requestBody") else {
            return Ok(ApiBody::None);
        };
        let rb = resolve(self.doc, rb)?;
        let required = rb["required"] == true;
        // A GET or HEAD is sent without a body: an optional one is left out.
        if matches!(self.method, "get" | "head") {
            if required {
                return Err(
                    "it requires a request body on a GET or HEAD, which this worker never sends"
                        .into(),
                );
            }
            return Ok(ApiBody::None);
        }
        let content = rb["content"].as_object().cloned().unwrap_or_default();
        let json = content.iter().find(|(t, _)| {
            let t = t.split(';').next().unwrap_or("").trim();
            t == "application/json" || t.ends_with("+json")
        });
        let Some((_, media)) = json else {
            if required {
                let kinds: Vec<&String> = content.keys().collect();
                return Err(format!(
                    "its request body is not JSON ({kinds:?}); a tool sends JSON"
                ));
            }
            return Ok(ApiBody::None);
        };
        let schema = media.get("schema").cloned().unwrap_or_else(|| json!({}));
        let props = schema["properties"].as_object().filter(|_| {
            schema["type"] == "object"
                && ["allOf", "anyOf", "oneOf"]
                    .iter()
                    .all(|k| schema.get(*k).is_none())
        });
        match props {
            Some(p) if p.keys().all(|k| !args.props.contains_key(k)) => {
                let inner: Vec<&str> = schema["required"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                for (k, s) in p {
                    args.add(k, s.clone(), required && inner.contains(&k.as_str()))?;
                }
                Ok(ApiBody::Fields(p.keys().cloned().collect()))
            }
            _ => {
                args.add("body", schema, required)?;
                Ok(ApiBody::Whole("body".into()))
            }
        }
    }
}
