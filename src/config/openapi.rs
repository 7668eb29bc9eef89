//! Tools from an OpenAPI 3.0 or 3.1 document: a catalog's `[[openapi]]` source names the
//! document (a file or a URL, read when the catalog is loaded) and the operations to expose,
//! and each operation becomes an HTTP tool whose request is built from the document (see
//! `docs/catalog.md`). What cannot be mapped is an error naming the operation.

use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::kernel::ToolSpec;
use crate::kernel::api::{ApiAuth, ApiBody, ApiCall, ApiParam, Place};
use crate::kernel::catalog::{Access, Approval, HttpSpec, Requires, RetryPolicy};

/// The largest document read.
const DOCUMENT_BYTES_MAX: usize = 16 << 20;
/// How deep `$ref`s may nest before a schema is refused.
const REF_DEPTH_MAX: usize = 32;
/// The methods whose operations become tools.
const METHODS: [&str; 6] = ["get", "head", "post", "put", "patch", "delete"];

/// One `[[openapi]]` source of a catalog file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Source {
    /// A file (relative to the catalog) or an http(s) URL.
    document: String,
    /// Where the API is; default: the document's first `servers` URL (relative to the
    /// document's URL), else the origin of the document's URL.
    #[serde(default)]
    base_url: Option<String>,
    /// The operations to expose, by `operationId` (default: all).
    #[serde(default)]
    operations: Option<Vec<String>>,
    /// Operations never exposed.
    #[serde(default)]
    exclude: Vec<String>,
    /// `Authorization: Bearer $VAR` on every request.
    #[serde(default)]
    bearer_env: Option<String>,
    /// An API key from `$VAR`, in the header the document's `apiKey` scheme names (or
    /// `api_key_header`).
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default)]
    api_key_header: Option<String>,
    /// Per-tool options, by tool name.
    #[serde(default)]
    tools: BTreeMap<String, Overrides>,
}

/// The options of a catalog tool that an operation's tool may set.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Overrides {
    description: Option<String>,
    access: Option<Access>,
    idempotent: Option<bool>,
    #[serde(default)]
    fact_fields: Vec<String>,
    #[serde(default)]
    fact_prefix_arg: String,
    #[serde(default)]
    done_phrase: String,
    #[serde(default)]
    not_done_phrase: String,
    #[serde(default)]
    approval: Approval,
    #[serde(default)]
    requires: Requires,
    timeout_ms: Option<u64>,
    lookup_url: Option<String>,
    auto_settle: Option<bool>,
    lookup_grace_ms: Option<u64>,
    approval_secret_env: Option<String>,
    retry: Option<RetryPolicy>,
}

/// The tools of one source, in the document's order of paths and methods.
pub(super) fn tools_of(src: &Source, catalog: &Path) -> Result<Vec<ToolSpec>, String> {
    let at = |e: String| format!("openapi document {}: {e}", src.document);
    let doc = read_document(&src.document, catalog).map_err(at)?;
    let base = base_url(src, &doc).map_err(at)?;
    let auth = auth_of(src, &doc).map_err(at)?;
    let mut tools = Vec::new();
    let mut names = BTreeSet::new();
    let paths = doc["paths"]
        .as_object()
        .ok_or_else(|| at("it has no paths".into()))?;
    for (path, item) in paths {
        // A path item may itself be a `$ref`; its operations are resolved one by one, so
        // that an error names the operation.
        let item = match item["$ref"].as_str().and_then(|r| r.strip_prefix('#')) {
            Some(p) => doc.pointer(p).cloned().unwrap_or(Value::Null),
            None => item.clone(),
        };
        for method in METHODS {
            let Some(op) = item.get(method) else { continue };
            let name = tool_name(op, method, path).map_err(at)?;
            let id = op["operationId"].as_str().unwrap_or(&name);
            let wanted = src
                .operations
                .as_ref()
                .is_none_or(|o| o.iter().any(|w| w == id || *w == name));
            if !wanted || src.exclude.iter().any(|x| x == id || *x == name) {
                continue;
            }
            let mut op_ = Operation {
                doc: &doc,
                item: &item,
                op,
                method,
                path,
                auth: &auth,
            };
            let o = src.tools.get(&name);
            let tool = op_.tool(&name, &base, o).map_err(|e| {
                at(format!(
                    "operation {id:?} ({} {path}): {e}",
                    method.to_uppercase()
                ))
            })?;
            names.insert(name.clone());
            names.insert(id.to_string());
            tools.push(tool);
        }
    }
    let missing: Vec<&String> = src
        .operations
        .iter()
        .flatten()
        .chain(src.tools.keys())
        .filter(|n| !names.contains(*n))
        .collect();
    if !missing.is_empty() {
        return Err(at(format!(
            "no exposed operation is called {} (its operations: {})",
            missing
                .iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            operation_ids(paths).join(", ")
        )));
    }
    if tools.is_empty() {
        return Err(at("no operation is left to expose".into()));
    }
    Ok(tools)
}

/// Every operation's id (or derived name), for an error that names what there is.
fn operation_ids(paths: &Map<String, Value>) -> Vec<String> {
    let mut out = Vec::new();
    for (path, item) in paths {
        for m in METHODS {
            if let Some(op) = item.get(m) {
                out.push(tool_name(op, m, path).unwrap_or_else(|e| e));
            }
        }
    }
    out
}

/// The document, read from its URL or its file, as JSON.
fn read_document(document: &str, catalog: &Path) -> Result<Value, String> {
    let text = if document.starts_with("http://") || document.starts_with("https://") {
        crate::net::check_url(document)?;
        let mut resp = crate::net::agent(std::time::Duration::from_secs(10))
            .get(document)
            .call()
            .map_err(|e| format!("cannot fetch it: {e}"))?;
        let status = resp.status().as_u16();
        let text = crate::net::read_body(&mut resp, DOCUMENT_BYTES_MAX)?;
        if status != 200 {
            return Err(format!(
                "fetching it answered HTTP {status}: {}",
                crate::net::clip(&text)
            ));
        }
        text
    } else {
        let p = catalog.parent().unwrap_or(Path::new(".")).join(document);
        crate::limits::read_file(&p, DOCUMENT_BYTES_MAX)
            .map_err(|e| format!("{}: {e}", p.display()))?
    };
    let doc: Value = serde_json::from_str(&text).map_err(|e| {
        let t = text.trim_start();
        if t.starts_with("openapi:") || t.starts_with("swagger:") || t.starts_with("---") {
            "it is YAML; this build reads the JSON form of a document (convert it, or name the URL where the service serves its JSON)".to_string()
        } else {
            format!("it is not JSON: {e}")
        }
    })?;
    match doc["openapi"].as_str() {
        Some(v) if v.starts_with("3.") => Ok(doc),
        Some(v) => Err(format!("OpenAPI {v} is not read; a 3.0 or 3.1 document is")),
        None if doc.get("swagger").is_some() => {
            Err("it is a Swagger 2.0 document; a 3.0 or 3.1 document is read (convert it)".into())
        }
        None => Err("it has no \"openapi\" version field: it is not an OpenAPI document".into()),
    }
}

/// Where requests go: `base_url`, else the first server (its variables at their defaults,
/// relative to the document's URL), else the document URL's origin.
fn base_url(src: &Source, doc: &Value) -> Result<String, String> {
    let from_doc = || -> Option<String> {
        let s = doc["servers"].get(0)?;
        let mut url = s["url"].as_str()?.to_string();
        for (k, v) in s["variables"].as_object().into_iter().flatten() {
            url = url.replace(&format!("{{{k}}}"), v["default"].as_str().unwrap_or(""));
        }
        Some(url)
    };
    let url = src.base_url.clone().or_else(from_doc).unwrap_or_default();
    let url = if url.starts_with("http://") || url.starts_with("https://") {
        url
    } else if let Some(origin) = origin(&src.document) {
        format!("{origin}/{}", url.trim_start_matches('/'))
    } else {
        return Err("the API's address is not known: the document names no absolute server URL and is a file; set base_url".into());
    };
    crate::net::check_url(&url).map_err(|e| format!("base_url: {e}"))?;
    Ok(url.trim_end_matches('/').to_string())
}

/// `scheme://host:port` of a URL.
fn origin(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("http://")
        .map(|r| ("http", r))
        .or_else(|| url.strip_prefix("https://").map(|r| ("https", r)))?;
    let host = rest.1.split(['/', '?', '#']).next()?;
    Some(format!("{}://{host}", rest.0))
}

/// The headers the daemon fills from its environment.
fn auth_of(src: &Source, doc: &Value) -> Result<Vec<ApiAuth>, String> {
    let mut auth = Vec::new();
    if let Some(env) = &src.bearer_env {
        auth.push(ApiAuth {
            header: "Authorization".into(),
            env: env.clone(),
            bearer: true,
        });
    }
    if let Some(env) = &src.api_key_env {
        let from_doc = doc["components"]["securitySchemes"]
            .as_object()
            .into_iter()
            .flat_map(|m| m.values())
            .find(|s| s["type"] == "apiKey" && s["in"] == "header")
            .and_then(|s| s["name"].as_str().map(String::from));
        let header = src.api_key_header.clone().or(from_doc).ok_or(
            "api_key_env is set, but the document has no apiKey scheme in a header; name it with api_key_header",
        )?;
        auth.push(ApiAuth {
            header,
            env: env.clone(),
            bearer: false,
        });
    } else if src.api_key_header.is_some() {
        return Err("api_key_header needs api_key_env (the variable the key comes from)".into());
    }
    for a in &auth {
        crate::limits::check_name(&a.env, "an auth variable name").map_err(|e| e.0)?;
        http::HeaderName::from_bytes(a.header.as_bytes())
            .map_err(|_| format!("{:?} is not a header name", a.header))?;
    }
    Ok(auth)
}

/// The tool's name: the `operationId` with any character a function name cannot hold as
/// `_`, or `METHOD_path` when there is none.
fn tool_name(op: &Value, method: &str, path: &str) -> Result<String, String> {
    let raw = match op["operationId"].as_str() {
        Some(id) => id.to_string(),
        None => format!("{method}_{path}"),
    };
    let mut name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    while name.contains("__") && op["operationId"].is_null() {
        name = name.replace("__", "_");
    }
    let name = name.trim_matches('_').to_string();
    if name.is_empty() || name.len() > 64 {
        return Err(format!(
            "operation {raw:?}: a tool name is 1 to 64 letters, digits, '_' and '-' (a model's function name); give the operation an operationId that fits"
        ));
    }
    Ok(name)
}

/// `v` with every local `$ref` replaced by what it points to (sibling keywords kept over
/// it) and OpenAPI 3.0's `nullable` written as JSON Schema. A schema that refers to itself
/// cannot be shown to a model whole, and is refused.
pub(super) fn resolve(doc: &Value, v: &Value, stack: &mut Vec<String>) -> Result<Value, String> {
    if stack.len() > REF_DEPTH_MAX {
        return Err(format!(
            "$refs nest deeper than {REF_DEPTH_MAX}: {}",
            stack.join(" -> ")
        ));
    }
    match v {
        Value::Object(m) => {
            if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                let Some(pointer) = r.strip_prefix('#') else {
                    return Err(format!(
                        "$ref {r:?} points outside the document; only references inside it (#/...) are read"
                    ));
                };
                if stack.iter().any(|s| s == r) {
                    return Err(format!(
                        "{r} refers to itself ({} -> {r}); a recursive schema cannot be given to a model",
                        stack.join(" -> ")
                    ));
                }
                let target = doc
                    .pointer(pointer)
                    .ok_or_else(|| format!("$ref {r:?} points to nothing in the document"))?;
                stack.push(r.to_string());
                let mut out = resolve(doc, target, stack)?;
                stack.pop();
                if let Value::Object(o) = &mut out {
                    for (k, x) in m.iter().filter(|(k, _)| *k != "$ref") {
                        o.insert(k.clone(), resolve(doc, x, stack)?);
                    }
                }
                return Ok(out);
            }
            let mut out = Map::new();
            for (k, x) in m {
                out.insert(k.clone(), resolve(doc, x, stack)?);
            }
            if out.remove("nullable") == Some(Value::Bool(true))
                && let Some(Value::String(t)) = out.get("type").cloned()
            {
                out.insert("type".into(), json!([t, "null"]));
            }
            Ok(Value::Object(out))
        }
        Value::Array(a) => a
            .iter()
            .map(|x| resolve(doc, x, stack))
            .collect::<Result<_, _>>()
            .map(Value::Array),
        v => Ok(v.clone()),
    }
}

/// One operation of the document, being made into a tool.
struct Operation<'a> {
    doc: &'a Value,
    item: &'a Value,
    op: &'a Value,
    method: &'a str,
    path: &'a str,
    auth: &'a [ApiAuth],
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
    fn tool(&mut self, name: &str, base: &str, o: Option<&Overrides>) -> Result<ToolSpec, String> {
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
                let p = resolve(self.doc, p, &mut Vec::new())?;
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
            if place == Place::Header
                && self
                    .auth
                    .iter()
                    .any(|a| a.header.eq_ignore_ascii_case(name))
            {
                continue;
            }
            if place == Place::Header
                && ["authorization", "idempotency-key", "content-type", "accept"]
                    .contains(&name.to_ascii_lowercase().as_str())
            {
                if required {
                    return Err(format!(
                        "the header {name:?} is set by the worker, not the model (auth: bearer_env or api_key_env)"
                    ));
                }
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
            if place == Place::Path && !self.path.contains(&format!("{{{name}}}")) {
                return Err(format!("the path has no {{{name}}} for its path parameter"));
            }
            args.add(name, schema, required)?;
            out.push(ApiParam {
                arg: name.to_string(),
                name: name.to_string(),
                place,
            });
        }
        Ok(out)
    }

    /// The JSON request body: an object's properties as arguments of their own, or the
    /// whole body as the argument `body`.
    fn body(&self, args: &mut Args) -> Result<ApiBody, String> {
        let Some(rb) = self.op.get("requestBody") else {
            return Ok(ApiBody::None);
        };
        let rb = resolve(self.doc, rb, &mut Vec::new())?;
        let required = rb["required"] == true;
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
