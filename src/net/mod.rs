//! HTTP shared by the model and tool adapters: the blocking client (ureq) of the threads that
//! are not the executor's (the settler's lookups, the callback sender, the span exporter), an
//! agent bounded by a timeout that never follows redirects; the executor's asynchronous
//! HTTP/1.1 client ([`h1`], its routes, proxies and idle connections in [`route`]); the send
//! gate of MCP's client ([`gate`]); the check every configured URL passes, the retry backoff,
//! bounded body reads and clipped error texts.

pub mod answer;
pub mod gate;
pub mod h1;
pub mod route;

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

/// What a gated connection asks before its first byte: `Err` says why nothing may be sent.
pub type Ready = std::sync::Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A random number of milliseconds from 0 to `max_ms`, so that calls that failed together do
/// not retry together.
pub fn jitter(max_ms: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(max_ms);
    h.finish() % (max_ms + 1)
}

/// The wait a response asks for before the next attempt: `retry-after-ms` (OpenAI's), or
/// `Retry-After` in seconds or as an HTTP date (RFC 9110's IMF-fixdate, `Wed, 21 Oct 2015
/// 07:28:00 GMT`: the time until then, by this host's clock).
pub fn retry_after(h: &ureq::http::HeaderMap) -> Option<Duration> {
    let date = h
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(http_date_ms);
    if let Some(at_ms) = date {
        return Some(Duration::from_millis(
            at_ms.saturating_sub(crate::clock::now_ms()),
        ));
    }
    retry_after_number(h)
}

/// Milliseconds since the epoch of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`).
pub fn http_date_ms(text: &str) -> Option<u64> {
    let rest = text.trim().split_once(", ")?.1;
    let f: Vec<&str> = rest.split(' ').collect();
    let [day, month, year, time, "GMT"] = f.as_slice() else {
        return None;
    };
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| m == month)? as i64
        + 1;
    let (day, year): (i64, i64) = (day.parse().ok()?, year.parse().ok()?);
    let t: Vec<i64> = time
        .split(':')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let [hh, mm, ss] = t.as_slice() else {
        return None;
    };
    if !(1..=31).contains(&day)
        || !(1970..=9999).contains(&year)
        || *hh > 23
        || *mm > 59
        || *ss > 60
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000).ok()
}

fn retry_after_number(h: &ureq::http::HeaderMap) -> Option<Duration> {
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
    // The port as a request reads it (`http` reads 99999 as no port at all).
    route::Origin::of(&uri)
        .map_err(|_| format!("{shown:?}: the port is not a number from 1 to 65535"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A port out of range in a configured URL is refused where the URL is checked, not
    /// turned into the scheme's own port when a request is made.
    #[test]
    fn a_url_with_a_port_out_of_range_is_refused() {
        for bad in ["http://127.0.0.1:99999/v1", "https://api.example.com:0"] {
            let e = check_url(bad).unwrap_err();
            assert!(
                e.contains("the port is not a number from 1 to 65535"),
                "{bad}: {e}"
            );
        }
        for good in [
            "http://127.0.0.1:8080/v1",
            "https://[::1]:443/",
            "https://api.example.com",
        ] {
            assert_eq!(check_url(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn http_dates_are_read_as_rfc_9110_writes_them() {
        assert_eq!(
            http_date_ms("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(784_111_777_000)
        );
        assert_eq!(http_date_ms("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(
            http_date_ms("Tue, 29 Feb 2028 23:59:59 GMT"),
            Some(1_835_481_599_000)
        );
        for bad in [
            "120",
            "Sun, 06 Nov 1994 08:49:37 PST",
            "06 Nov 1994",
            "Sun, 32 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(http_date_ms(bad), None, "{bad}");
        }
    }
}
