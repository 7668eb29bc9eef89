//! Tools from an OpenAPI 3.0 or 3.1 document: a catalog's `[[openapi]]` source names the
//! document (a file or a URL, read when the catalog is loaded) and the operations to expose,
//! and each operation becomes an HTTP tool whose request is built from the document (see
//! `docs/catalog.md`). What cannot be mapped is an error naming the operation.

use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

use crate::kernel::ToolSpec;
use crate::kernel::api::ApiAuth;
use crate::kernel::catalog::{Access, Approval, Requires, RetryPolicy};

mod operation;
mod schema;

use operation::Operation;

/// The largest document read.
const DOCUMENT_BYTES_MAX: usize = 16 << 20;
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
    let paths = doc["paths"]
        .as_object()
        .ok_or_else(|| at("it has no paths".into()))?;
    let all = operations(&doc, paths).map_err(at)?;
    names_known(src, &all).map_err(at)?;
    let mut tools = Vec::new();
    for o in &all {
        let named = |list: &[String]| list.iter().any(|w| *w == o.id || *w == o.name);
        if !src.operations.as_deref().is_none_or(named) || named(&src.exclude) {
            continue;
        }
        let options = match (src.tools.get(&o.name), src.tools.get(&o.id)) {
            (Some(_), Some(_)) if o.name != o.id => {
                return Err(at(format!(
                    "options for operation {:?} are given twice: as tools.{} and tools.{:?}",
                    o.id, o.name, o.id
                )));
            }
            (a, b) => a.or(b),
        };
        let mut op = Operation {
            doc: &doc,
            item: &o.item,
            op: &o.op,
            method: o.method,
            path: &o.path,
            auth: &auth,
        };
        let tool = op.tool(&o.name, &base, options).map_err(|e| {
            at(format!(
                "operation {:?} ({} {}): {e}",
                o.id,
                o.method.to_uppercase(),
                o.path
            ))
        })?;
        if let Some(other) = tools.iter().find(|t: &&ToolSpec| t.name == tool.name) {
            let first = other.http.as_ref().and_then(|h| h.api.as_ref());
            return Err(at(format!(
                "operations {:?} and {:?} both make the tool {:?}; give one another operationId, or exclude one",
                first.map_or("?", |a| a.operation.as_str()),
                o.id,
                tool.name
            )));
        }
        tools.push(tool);
    }
    if tools.is_empty() {
        return Err(at("no operation is left to expose".into()));
    }
    Ok(tools)
}

/// Every name `operations`, `exclude` or an option gives must be an operation's (by tool
/// name or id): an error lists the ones that are not, and the operations there are.
fn names_known(src: &Source, all: &[Found]) -> Result<(), String> {
    let known = |n: &String| all.iter().any(|o| o.name == *n || o.id == *n);
    let lists = src.operations.iter().flatten().chain(&src.exclude);
    let unknown: Vec<String> = lists
        .chain(src.tools.keys())
        .filter(|n| !known(n))
        .map(|n| format!("{n:?}"))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let there: Vec<&str> = all.iter().map(|o| o.id.as_str()).collect();
    Err(format!(
        "no operation is called {} (its operations: {})",
        unknown.join(", "),
        there.join(", ")
    ))
}

/// One operation of the document: its path item, the operation, and its names.
struct Found {
    item: Value,
    op: Value,
    method: &'static str,
    path: String,
    /// Its tool name, and its `operationId` (the tool name when it has none).
    name: String,
    id: String,
}

/// Every operation of the document's paths, in order.
fn operations(doc: &Value, paths: &Map<String, Value>) -> Result<Vec<Found>, String> {
    let mut out = Vec::new();
    for (path, item) in paths {
        // A path item may itself be a `$ref`; its operations are resolved one by one, so
        // that an error names the operation.
        let item = match item["$ref"].as_str() {
            Some(r) => r
                .strip_prefix('#')
                .and_then(|p| doc.pointer(p))
                .cloned()
                .ok_or_else(|| {
                    format!("path {path}: $ref {r:?} points to nothing in the document")
                })?,
            None => item.clone(),
        };
        for method in METHODS {
            let Some(op) = item.get(method) else { continue };
            if !op.is_object() {
                return Err(format!(
                    "{} {path}: an operation is an object, not {op}",
                    method.to_uppercase()
                ));
            }
            let name = tool_name(op, method, path)?;
            let id = op["operationId"].as_str().unwrap_or(&name).to_string();
            out.push(Found {
                item: item.clone(),
                op: op.clone(),
                method,
                path: path.clone(),
                name,
                id,
            });
        }
    }
    Ok(out)
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
        if (300..400).contains(&status) {
            let to = resp
                .headers()
                .get("location")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("nowhere");
            return Err(format!(
                "fetching it answered HTTP {status} pointing to {:?}; redirects are not followed: name that URL",
                crate::net::clip(to)
            ));
        }
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
        None if doc.get("openapi").is_some() => Err(format!(
            "its \"openapi\" version is {}, not a string such as \"3.1.0\"",
            doc["openapi"]
        )),
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
    // Without servers, OpenAPI's default server is "/".
    let url = src
        .base_url
        .clone()
        .or_else(from_doc)
        .unwrap_or_else(|| "/".into());
    let url = if url.starts_with("http://") || url.starts_with("https://") {
        url
    } else if src.document.starts_with("http://") || src.document.starts_with("https://") {
        // Relative to the document's own URL (RFC 3986), as OpenAPI says.
        let doc_url = reqwest::Url::parse(&src.document).map_err(|e| e.to_string())?;
        doc_url
            .join(&url)
            .map_err(|e| format!("server URL {url:?}: {e}"))?
            .to_string()
    } else {
        return Err("the API's address is not known: the document names no absolute server URL and is a file; set base_url".into());
    };
    crate::net::check_url(&url).map_err(|e| format!("base_url: {e}"))?;
    Ok(url.trim_end_matches('/').to_string())
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn relative_servers_resolve_against_the_documents_url() {
        let doc_url = "http://127.0.0.1:9/api/doc.json";
        for (server, want) in [
            (Some("v2"), "http://127.0.0.1:9/api/v2"),
            (Some("/v1/"), "http://127.0.0.1:9/v1"),
            (Some("//other.test:8/base"), "http://other.test:8/base"),
            (Some("https://x.test/{ver}"), "https://x.test/3"),
            (None, "http://127.0.0.1:9"),
        ] {
            let src: Source = toml::from_str(&format!("document = \"{doc_url}\"")).expect("src");
            let doc = match server {
                Some(s) => json!({"servers": [{"url": s, "variables": {"ver": {"default": "3"}}}]}),
                None => json!({}),
            };
            assert_eq!(base_url(&src, &doc).as_deref(), Ok(want), "{server:?}");
        }
        let src: Source = toml::from_str("document = \"api.json\"").expect("src");
        let e = base_url(&src, &json!({"servers": [{"url": "/v1"}]})).expect_err("a file");
        assert!(e.contains("set base_url"), "{e}");
    }
}
