//! The blocking HTTP client (ureq) shared by the model and tool adapters: an agent bounded by
//! a timeout that never follows redirects, the check every configured URL passes, the retry
//! backoff, bounded body reads and clipped error texts. It fits the
//! thread-per-task daemon: no async runtime.

use std::time::Duration;

/// An agent whose every request ends within `timeout`; HTTP statuses are answers, not errors.
/// Redirects are never followed: a 3xx is the answer. Following one would send a tool call
/// (its Idempotency-Key and approval) or a model request to wherever the answer points, and a
/// POST would become a GET whose answer says nothing of the write.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}

/// A random number of milliseconds from 0 to `max_ms`, so that calls that failed together do
/// not retry together.
pub fn jitter(max_ms: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(max_ms);
    h.finish() % (max_ms + 1)
}

/// The wait a response asks for before the next attempt: `retry-after-ms` (OpenAI's), or
/// `Retry-After` in seconds (an HTTP date is not followed: the caller's backoff applies).
pub fn retry_after(h: &ureq::http::HeaderMap) -> Option<Duration> {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_millis(ms as u64));
    }
    let secs = get("retry-after")?.parse::<f64>().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_millis((secs * 1000.0) as u64))
}

/// A response body of at most `max_bytes`, as text.
pub fn read_body(
    resp: &mut ureq::http::Response<ureq::Body>,
    max_bytes: usize,
) -> Result<String, String> {
    resp.body_mut()
        .with_config()
        .limit(max_bytes as u64)
        .read_to_string()
        .map_err(|e| match e {
            ureq::Error::BodyExceedsLimit(_) => {
                format!("the response body is over the limit of {max_bytes} bytes")
            }
            e => format!("the response body could not be read: {e}"),
        })
}

/// Whether `u` is an absolute `http://` or `https://` URL with a host, as the HTTP client will
/// read it: no whitespace or control characters, a host that is not empty, a port that is a
/// number. `Err` says what is wrong (the URL shown escaped).
pub fn check_url(u: &str) -> Result<(), String> {
    let shown = crate::limits::printable(u);
    if u.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!("{shown:?} contains a space or a control character"));
    }
    let uri: http::Uri = u
        .parse()
        .map_err(|e| format!("{shown:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("{shown:?} must be an http:// or https:// URL")),
    }
    let Some(auth) = uri.authority() else {
        return Err(format!("{shown:?} has no host"));
    };
    let host = auth.host();
    if host.is_empty() || host == "[]" {
        return Err(format!("{shown:?} has no host"));
    }
    let name_ok = host.starts_with('[')
        || (host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
            && !host.starts_with(['-', '.'])
            && !host.ends_with('-'));
    if !name_ok {
        return Err(format!("{shown:?}: {host:?} is not a host name or address"));
    }
    if auth.port().is_some() && auth.port_u16().is_none() {
        return Err(format!(
            "{shown:?}: the port is not a number from 0 to 65535"
        ));
    }
    if u.contains('#') {
        return Err(format!(
            "{shown:?} has a fragment (#...), which a request never sends"
        ));
    }
    if auth.as_str().contains('@') {
        return Err(format!(
            "{shown:?} carries a user name or password; give credentials another way"
        ));
    }
    Ok(())
}

/// At most 200 characters of a text, for error messages and logs.
pub fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}
