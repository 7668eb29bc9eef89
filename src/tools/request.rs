//! The request an HTTP tool's call sends, before the call key and an approval are added: a
//! catalog tool's `POST url` with `{"user_id", "args"}`, or, for a tool made from an OpenAPI
//! operation, the operation's method and path with each argument in its place. Path values
//! are percent-encoded whole (a `/`, `?` or `#` in a value stays inside its segment, and `.`
//! and `..` are refused), so no argument can change the host or climb the path.

use serde_json::{Map, Value, json};

use crate::kernel::api::{ApiBody, ApiCall, Place};
use crate::kernel::catalog::HttpSpec;

/// One request, ready to send.
#[derive(Debug)]
pub struct Built {
    pub method: String,
    pub url: String,
    pub headers: Vec<(String, String)>,
    /// JSON text, sent with `Content-Type: application/json`.
    pub body: Option<String>,
}

/// A call that cannot be sent as it is: its error code and what was wrong. Nothing was sent.
pub type Refusal = (&'static str, String);

/// The request of a call with these arguments, for the task's user.
pub fn build(http: &HttpSpec, user_id: &str, args: &Map<String, Value>) -> Result<Built, Refusal> {
    match &http.api {
        None => Ok(Built {
            method: http.method.clone(),
            url: http.url.clone(),
            headers: Vec::new(),
            body: Some(
                json!({"user_id": user_id, "args": Value::Object(args.clone())}).to_string(),
            ),
        }),
        Some(api) => from_operation(http, api, args),
    }
}

fn invalid(detail: String) -> Refusal {
    ("invalid_args", detail)
}

fn from_operation(
    http: &HttpSpec,
    api: &ApiCall,
    args: &Map<String, Value>,
) -> Result<Built, Refusal> {
    let mut path = api.path.clone();
    let mut query = Vec::new();
    let mut headers = Vec::new();
    for p in &api.params {
        let Some(v) = args.get(&p.arg).filter(|v| !v.is_null()) else {
            if p.place == Place::Path {
                return Err(invalid(format!(
                    "the path parameter {:?} is missing",
                    p.arg
                )));
            }
            continue;
        };
        match p.place {
            Place::Path => {
                let text = scalar_text(v);
                if text.is_empty() || text == "." || text == ".." {
                    return Err(invalid(format!(
                        "the path parameter {:?} cannot be {text:?}: it would change the path",
                        p.arg
                    )));
                }
                path = path.replace(&format!("{{{}}}", p.name), &encode(&text));
            }
            Place::Query => match v {
                Value::Array(items) => {
                    for i in items {
                        query.push(format!("{}={}", encode(&p.name), encode(&scalar_text(i))));
                    }
                }
                v => query.push(format!("{}={}", encode(&p.name), encode(&scalar_text(v)))),
            },
            Place::Header => {
                let text = scalar_text(v);
                if text.chars().any(|c| c.is_control()) {
                    return Err(invalid(format!(
                        "the header parameter {:?} holds a control character",
                        p.arg
                    )));
                }
                headers.push((p.name.clone(), text));
            }
        }
    }
    headers.extend(auth_headers(api)?);
    let body = body_of(api, args);
    let mut url = format!("{}{path}", http.url.trim_end_matches('/'));
    if !query.is_empty() {
        url.push('?');
        url.push_str(&query.join("&"));
    }
    Ok(Built {
        method: http.method.clone(),
        url,
        headers,
        body,
    })
}

/// The headers filled from the daemon's environment (an API key, a bearer token).
pub fn auth_headers(api: &ApiCall) -> Result<Vec<(String, String)>, Refusal> {
    let mut headers = Vec::new();
    for a in &api.auth {
        let value = std::env::var(&a.env).ok().filter(|s| !s.is_empty()).ok_or_else(|| {
            (
                "auth_not_set",
                format!(
                    "{} (the variable this API's {} comes from) is not set in this worker's environment; nothing was sent",
                    a.env, a.header
                ),
            )
        })?;
        let value = if a.bearer {
            format!("Bearer {value}")
        } else {
            value
        };
        headers.push((a.header.clone(), value));
    }
    Ok(headers)
}

/// The JSON body of the call: the fields the body takes, or the one whole-body argument.
fn body_of(api: &ApiCall, args: &Map<String, Value>) -> Option<String> {
    match &api.body {
        ApiBody::None => None,
        ApiBody::Whole(arg) => args.get(arg).map(Value::to_string),
        ApiBody::Fields(fields) => {
            let obj: Map<String, Value> = fields
                .iter()
                .filter_map(|f| Some((f.clone(), args.get(f)?.clone())))
                .collect();
            Some(Value::Object(obj).to_string())
        }
    }
}

/// A value as the text of a path segment, a query value or a header: a string as it is, a
/// list as its items joined by commas (OpenAPI's `simple` style), anything else as JSON.
fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().map(scalar_text).collect::<Vec<_>>().join(","),
        v => v.to_string(),
    }
}

/// Percent-encodes every byte but RFC 3986's unreserved characters, so that a value stays
/// one path segment or one query value whatever it holds.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::api::ApiParam;

    fn spec(params: Vec<ApiParam>, body: ApiBody) -> HttpSpec {
        let toml = "url = \"http://api.test/v1/\"\nmethod = \"PATCH\"\n";
        let mut h: HttpSpec = toml::from_str(toml).expect("spec");
        h.api = Some(ApiCall {
            operation: "update".into(),
            path: "/tickets/{ticket_id}".into(),
            schema: json!({"type": "object"}),
            params,
            body,
            auth: Vec::new(),
        });
        h
    }

    fn param(arg: &str, place: Place) -> ApiParam {
        ApiParam {
            arg: arg.into(),
            name: arg.into(),
            place,
        }
    }

    #[test]
    fn a_path_value_stays_in_its_segment() {
        let h = spec(vec![param("ticket_id", Place::Path)], ApiBody::None);
        for (value, path) in [
            ("../admin", "/v1/tickets/..%2Fadmin"),
            ("x/../../y", "/v1/tickets/x%2F..%2F..%2Fy"),
            ("a?b=1#c", "/v1/tickets/a%3Fb%3D1%23c"),
            ("@evil.test", "/v1/tickets/%40evil.test"),
            ("tk 7", "/v1/tickets/tk%207"),
        ] {
            let args = json!({"ticket_id": value});
            let b = build(&h, "u", args.as_object().unwrap()).expect("built");
            assert_eq!(b.url, format!("http://api.test{path}"), "{value}");
        }
        for value in [".", "..", ""] {
            let args = json!({"ticket_id": value});
            let e = build(&h, "u", args.as_object().unwrap()).expect_err(value);
            assert_eq!(e.0, "invalid_args", "{value}");
        }
    }

    #[test]
    fn query_header_and_body_take_their_arguments() {
        let h = spec(
            vec![
                param("ticket_id", Place::Path),
                param("notify", Place::Query),
                param("tags", Place::Query),
                param("X-Trace", Place::Header),
            ],
            ApiBody::Fields(vec!["title".into(), "status".into()]),
        );
        let args = json!({"ticket_id": 7, "notify": true, "tags": ["a b", "c&d"],
                          "X-Trace": "t1", "title": "New", "status": null});
        let b = build(&h, "u", args.as_object().unwrap()).expect("built");
        assert_eq!(
            b.url,
            "http://api.test/v1/tickets/7?notify=true&tags=a%20b&tags=c%26d"
        );
        assert_eq!(b.headers, [("X-Trace".to_string(), "t1".to_string())]);
        let body: Value = serde_json::from_str(b.body.as_deref().unwrap()).unwrap();
        assert_eq!(body, json!({"title": "New", "status": null}));
        assert_eq!(b.method, "PATCH");
    }
}
