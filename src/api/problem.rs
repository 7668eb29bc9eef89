//! Errors of the HTTP API as RFC 9457 problem details (`application/problem+json`): `type`
//! `about:blank` with the status's own title, a `detail` that says what was wrong and what to
//! do, and a short machine-readable `code`.

use serde_json::json;

use crate::httpd::Reply;
use crate::store::Error;

/// A problem reply.
pub fn problem(status: u16, code: &str, detail: &str) -> Reply {
    let body = json!({
        "type": "about:blank",
        "title": title(status),
        "status": status,
        "detail": detail,
        "code": code,
    });
    Reply::Response {
        status,
        headers: vec![("Content-Type", "application/problem+json".into())],
        body: body.to_string().into_bytes(),
    }
}

/// A storage or decision error as the problem a caller gets.
pub fn of_store(e: &Error) -> Reply {
    match e {
        Error::NoTask(_) => problem(404, "not_found", &e.to_string()),
        Error::Invalid(m) => problem(422, "invalid", m),
        Error::Conflict(m) => problem(409, "conflict", m),
        Error::Unavailable(_) => problem(503, "unavailable", &e.to_string()),
        _ => {
            tracing::error!(error = %e, "api: the database failed");
            problem(500, "database", &e.to_string())
        }
    }
}

/// The reason phrase of the statuses the API answers with.
pub fn title(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}
