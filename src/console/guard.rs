//! The console's checks of where a request comes from, before any page or decision.
//!
//! - **Host.** A console without tokens trusts whoever can reach its loopback address, so it
//!   answers only requests addressed to a loopback name (`localhost`, `*.localhost`,
//!   `127.0.0.0/8`, `[::1]`). A page on `attacker.example` whose name was rebound to
//!   127.0.0.1 (DNS rebinding) reaches the socket, but its requests carry
//!   `Host: attacker.example` and are refused, so it can read no page and no CSRF token. A
//!   console with tokens authenticates every request, so any Host may reach it.
//! - **Origin and Sec-Fetch-Site.** A state-changing request (a POST) is refused when the
//!   browser says it comes from another site: `Sec-Fetch-Site` other than `same-origin` or
//!   `none`, or an `Origin` whose host and port are not the request's `Host`. Clients that
//!   send neither (curl, scripts) still need the form's CSRF token.

use crate::httpd::Request;

/// Why a request is refused, for a 403 page.
pub fn refused(req: &Request, loopback_only: bool) -> Option<String> {
    let host = header(req, "host").unwrap_or_default();
    if loopback_only && !is_loopback_host(&host) {
        return Some(format!(
            "This console answers only to loopback addresses (the request was for {:?}). Open it at http://127.0.0.1:PORT/ or http://localhost:PORT/.",
            crate::limits::printable(&host)
        ));
    }
    if req.method == "GET" || req.method == "HEAD" {
        return None;
    }
    if let Some(site) = header(req, "sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        return Some(format!(
            "The browser says this form was sent from another site (Sec-Fetch-Site: {}); decisions are taken only from the console's own pages.",
            crate::limits::printable(&site)
        ));
    }
    if let Some(origin) = header(req, "origin") {
        let from = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        if from.is_none_or(|o| !o.eq_ignore_ascii_case(&host)) {
            return Some(format!(
                "This form was sent from {:?}, not from the console ({:?}); decisions are taken only from the console's own pages.",
                crate::limits::printable(&origin),
                crate::limits::printable(&host)
            ));
        }
    }
    None
}

/// Text for an HTML page of its own (the refusal is written before any template runs).
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn header(req: &Request, name: &str) -> Option<String> {
    req.header(name)
        .map(|v| String::from_utf8_lossy(v).trim().to_string())
}

/// Whether a `Host` header names this machine's loopback interface.
pub fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [::1] or [::1]:8080
        match rest.split_once(']') {
            Some((ip, port)) if port.is_empty() || is_port(port) => ip,
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    let name = name.to_ascii_lowercase();
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    name.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

fn is_port(p: &str) -> bool {
    p.strip_prefix(':')
        .unwrap_or(p)
        .parse::<u16>()
        .is_ok_and(|_| !p.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: method.into(),
            path: "/tasks/t1/approve".into(),
            query: String::new(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
            body: Vec::new(),
        }
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "127.0.0.1:8080",
            "127.1.2.3",
            "localhost:80",
            "LOCALHOST",
            "app.localhost:9",
            "[::1]:8080",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "attacker.example:8080",
            "attacker.example",
            "127.0.0.1.nip.io",
            "localhost.attacker.example",
            "10.0.0.1:8080",
            "[::2]:80",
            "",
            "127.0.0.1:port",
            "[::1]x",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn cross_site_posts_are_refused() {
        let host = ("Host", "127.0.0.1:8080");
        assert!(refused(&req("GET", &[host]), true).is_none());
        assert!(refused(&req("GET", &[("Host", "attacker.example:8080")]), true).is_some());
        assert!(refused(&req("GET", &[("Host", "attacker.example:8080")]), false).is_none());
        assert!(refused(&req("POST", &[host]), true).is_none());
        assert!(
            refused(
                &req("POST", &[host, ("Origin", "http://127.0.0.1:8080")]),
                true
            )
            .is_none()
        );
        assert!(
            refused(
                &req("POST", &[host, ("Origin", "http://attacker.example")]),
                true
            )
            .is_some()
        );
        assert!(refused(&req("POST", &[host, ("Origin", "null")]), true).is_some());
        assert!(
            refused(
                &req("POST", &[host, ("Sec-Fetch-Site", "same-origin")]),
                true
            )
            .is_none()
        );
        assert!(
            refused(
                &req("POST", &[host, ("Sec-Fetch-Site", "cross-site")]),
                true
            )
            .is_some()
        );
        assert!(
            refused(
                &req("POST", &[host, ("Sec-Fetch-Site", "same-site")]),
                false
            )
            .is_some()
        );
    }
}
