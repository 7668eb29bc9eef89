//! `[callbacks]`: where completion callbacks may go and how they are signed. A task names its
//! callback URL (`enqueue --callback`, the API's `callback_url`, or its profile's
//! `callback_url`), but only a URL this section allows is ever POSTed to: a task never makes
//! the daemon send requests where its operator did not say it may.
//!
//! ```toml
//! [callbacks]
//! secret_env = "TETHER_WEBHOOK_SECRET"   # whsec_<base64>, as Standard Webhooks secrets are
//! allow = ["https://hooks.example.com/tether/", "http://127.0.0.1:*/"]
//! retry_for = "24h"                      # then given up, with an audit event (default 24h)
//! timeout = "10s"                        # per attempt (default 10s)
//! ```

use serde::Deserialize;

/// The `[callbacks]` section as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CallbacksEntry {
    secret_env: String,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    retry_for: Option<String>,
    #[serde(default)]
    timeout: Option<String>,
}

/// Where callbacks may go, how they are signed, and for how long they are tried.
#[derive(Clone, Debug, PartialEq)]
pub struct Callbacks {
    /// The environment variable holding the signing secret (`whsec_` and base64).
    pub secret_env: String,
    pub allow: Vec<AllowedUrl>,
    pub retry_for_ms: u64,
    pub timeout_ms: u64,
}

/// One `allow` entry: a scheme, a host, a port (or any, written `:*`) and a path prefix.
#[derive(Clone, Debug, PartialEq)]
pub struct AllowedUrl {
    pub text: String,
    scheme: String,
    host: String,
    port: Option<u16>,
    path: String,
}

/// A URL taken apart: scheme, host (lower case), port (the scheme's default when absent) and
/// path. Refused: anything but http(s), userinfo (`user@host`, which would let
/// `http://allowed.example@evil.example/` pass a prefix check), a fragment.
fn parts(url: &str) -> Result<(String, String, u16, String), String> {
    crate::net::check_url(url)?;
    let uri: http::Uri = url.parse().map_err(|e| format!("{url:?}: {e}"))?;
    let scheme = uri.scheme_str().unwrap_or_default().to_ascii_lowercase();
    let auth = uri
        .authority()
        .ok_or_else(|| format!("{url:?} has no host"))?;
    if auth.as_str().contains('@') {
        return Err(format!("{url:?}: a callback URL may not carry a user name"));
    }
    if url.contains('#') {
        return Err(format!("{url:?}: a callback URL may not have a fragment"));
    }
    let port = match auth.as_str().rsplit_once(':') {
        // A port that is written must be one: 1 to 65535 (`http::Uri` reads 99999 as none).
        Some((_, p)) if !p.ends_with(']') => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("{url:?}: {p:?} is not a port (1 to 65535)")),
        },
        _ => {
            if scheme == "https" {
                443
            } else {
                80
            }
        }
    };
    check_path(url, uri.path())?;
    Ok((
        scheme,
        auth.host().to_ascii_lowercase(),
        port,
        uri.path().to_string(),
    ))
}

/// A path a receiver reads as written: no dot segments (`/hooks/../admin`, which a server
/// that normalises paths serves as `/admin`), none percent-encoded, no encoded slash or
/// backslash, no `\\` or `;` (read as separators by some servers).
fn check_path(url: &str, path: &str) -> Result<(), String> {
    let lower = path.to_ascii_lowercase();
    let bad = path.contains(['\\', ';'])
        || ["%2e", "%2f", "%5c", "%3b"]
            .iter()
            .any(|e| lower.contains(e))
        || path.split('/').any(|seg| seg == "." || seg == "..");
    if bad {
        return Err(format!(
            "{url:?}: a callback URL's path may not hold `.` or `..` segments, `\\`, `;` or their percent-encodings"
        ));
    }
    Ok(())
}

impl AllowedUrl {
    pub fn parse(entry: &str) -> Result<AllowedUrl, String> {
        // `:*` (any port) is not URL syntax: take it out before parsing.
        let any_port = entry.contains(":*");
        let plain = entry.replacen(":*", "", 1);
        let (scheme, host, port, path) =
            parts(&plain).map_err(|e| format!("callbacks.allow: {e}"))?;
        Ok(AllowedUrl {
            text: entry.to_string(),
            scheme,
            host,
            port: (!any_port).then_some(port),
            path: if path.is_empty() { "/".into() } else { path },
        })
    }

    fn admits(&self, scheme: &str, host: &str, port: u16, path: &str) -> bool {
        self.scheme == scheme
            && self.host == host
            && self.port.is_none_or(|p| p == port)
            && path.starts_with(&self.path)
            // Whole segments: `/tether` admits `/tether` and `/tether/x`, not `/tetherevil`.
            && (self.path.ends_with('/')
                || path.len() == self.path.len()
                || path.as_bytes()[self.path.len()] == b'/')
    }
}

impl Callbacks {
    pub(super) fn from_entry(e: CallbacksEntry) -> Result<Callbacks, String> {
        if e.secret_env.trim().is_empty() {
            return Err(
                "callbacks.secret_env is empty: name the variable that holds the signing secret"
                    .into(),
            );
        }
        let allow = e
            .allow
            .iter()
            .map(|a| AllowedUrl::parse(a))
            .collect::<Result<Vec<_>, _>>()?;
        let duration = |v: &Option<String>, name: &str, default: u64| match v {
            None => Ok(default),
            Some(s) => crate::clock::parse_duration_ms(s)
                .map_err(|e| format!("callbacks.{name}: {e}"))
                .and_then(|ms| {
                    if ms == 0 {
                        Err(format!("callbacks.{name} must be more than 0"))
                    } else {
                        Ok(ms)
                    }
                }),
        };
        Ok(Callbacks {
            secret_env: e.secret_env,
            allow,
            retry_for_ms: duration(&e.retry_for, "retry_for", 24 * 3_600_000)?,
            timeout_ms: duration(&e.timeout, "timeout", 10_000)?,
        })
    }

    /// Whether a callback may go to `url`; `Err` says why not.
    pub fn check(&self, url: &str) -> Result<(), String> {
        let (scheme, host, port, path) = parts(url)?;
        if self
            .allow
            .iter()
            .any(|a| a.admits(&scheme, &host, port, &path))
        {
            return Ok(());
        }
        Err(format!(
            "{url:?} is not a callback URL the config allows (callbacks.allow: {})",
            if self.allow.is_empty() {
                "none".to_string()
            } else {
                self.allow
                    .iter()
                    .map(|a| a.text.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ))
    }

    /// The signing key: the secret's base64 after `whsec_`, decoded.
    pub fn key(&self) -> Result<Vec<u8>, String> {
        let var = &self.secret_env;
        let value = std::env::var(var)
            .map_err(|_| format!("the callbacks' signing secret variable {var} is not set"))?;
        signing_key(&value).map_err(|e| format!("{var}: {e}"))
    }
}

/// A Standard Webhooks secret (`whsec_` and base64) as its key bytes.
pub fn signing_key(secret: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let b64 = secret.trim().strip_prefix("whsec_").ok_or(
        "a signing secret is `whsec_` followed by base64 (make one with: echo whsec_$(head -c 32 /dev/urandom | base64))",
    )?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("the secret after whsec_ is not base64: {e}"))?;
    if key.len() < 24 {
        return Err("the secret is shorter than 24 bytes: make one of 32 random bytes".into());
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow(entries: &[&str]) -> Callbacks {
        Callbacks {
            secret_env: "X".into(),
            allow: entries
                .iter()
                .map(|e| AllowedUrl::parse(e).expect("entry"))
                .collect(),
            retry_for_ms: 1,
            timeout_ms: 1,
        }
    }

    #[test]
    fn only_the_allowed_hosts_ports_and_paths_pass() {
        let c = allow(&["https://hooks.example.com/tether/", "http://127.0.0.1:*/"]);
        assert!(c.check("https://hooks.example.com/tether/job-1").is_ok());
        assert!(c.check("https://HOOKS.example.com:443/tether/x").is_ok());
        assert!(c.check("http://127.0.0.1:9000/cb").is_ok());
        for bad in [
            "https://hooks.example.com/other",
            "http://hooks.example.com/tether/x",
            "https://hooks.example.com:8443/tether/x",
            "https://hooks.example.com.evil.example/tether/x",
            "http://127.0.0.1:80@evil.example/",
            "https://hooks.example.com/tether/x#frag",
            "http://169.254.169.254/latest/meta-data/",
            "file:///etc/passwd",
            // Dot segments and their encodings, which a normalising server reads as /admin.
            "https://hooks.example.com/tether/../admin",
            "https://hooks.example.com/tether/%2e%2e/admin",
            "https://hooks.example.com/tether/%2E%2e/admin",
            "https://hooks.example.com/tether/..%2fadmin",
            "https://hooks.example.com/tether/\\..\\admin",
            "https://hooks.example.com/tether/;/../admin",
            "https://hooks.example.com/tether/./x",
            // Ports that are none.
            "http://127.0.0.1:99999/cb",
            "http://127.0.0.1:0/cb",
            "http://127.0.0.1:84626/cb",
        ] {
            assert!(c.check(bad).is_err(), "{bad} passed");
        }
        let segment = allow(&["https://h.example/tether"]);
        assert!(segment.check("https://h.example/tether").is_ok());
        assert!(segment.check("https://h.example/tether/x").is_ok());
        assert!(segment.check("https://h.example/tetherevil").is_err());
        let none = allow(&[]);
        assert!(none.check("https://hooks.example.com/tether/").is_err());
    }

    #[test]
    fn a_secret_is_whsec_and_base64() {
        assert!(signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_ok());
        assert!(signing_key("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(signing_key("whsec_not base64!").is_err());
        assert!(signing_key("whsec_c2hvcnQ=").is_err());
    }
}
