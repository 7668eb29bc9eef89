//! Who may use the console and the API: loopback only, or the bearer tokens of a token file
//! (each names its holder and a role), compared in constant time.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use crate::api::{Caller, Role, UserPattern};

/// Who may use the console.
pub enum Access {
    /// Loopback only, as this operator (no sign-in).
    Loopback { operator: String },
    /// Tokens from the token file: token -> who (a name and a role).
    Tokens(BTreeMap<String, Caller>),
}

/// Who holds `token`, compared in constant time against every listed token (the time an
/// answer takes says nothing of how much of a guessed token was right).
pub(super) fn token_caller<'a>(
    tokens: &'a BTreeMap<String, Caller>,
    token: &str,
) -> Option<&'a Caller> {
    let given = Sha256::digest(token.as_bytes());
    let mut found = None;
    for (t, op) in tokens {
        let listed = Sha256::digest(t.as_bytes());
        let diff = given
            .iter()
            .zip(listed.iter())
            .fold(0u8, |a, (x, y)| a | (x ^ y));
        if diff == 0 {
            found = Some(op);
        }
    }
    found
}

/// Reads a token file: one `NAME TOKEN [ROLE] [users=PATTERN]` per line, the role `operator`
/// (the default: the console, decisions, every task) or `submit` (the API: create tasks and
/// read its own); a `submit` token's `users=` limits the users its tasks may act for (`*` any
/// run of characters: `users=cu_*`). `#` starts a comment. Tokens must be at least 16
/// characters, and unique.
pub fn read_tokens(text: &str) -> Result<BTreeMap<String, Caller>, String> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        // A comment starts at a `#` that begins the line or a word: a token may hold `#`.
        let cut = line
            .char_indices()
            .find(|&(i, c)| c == '#' && (i == 0 || line[..i].ends_with(char::is_whitespace)))
            .map_or(line.len(), |(i, _)| i);
        let line = line[..cut].trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(op), Some(token), role, users, None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(format!(
                "line {}: expected `NAME TOKEN [operator|submit] [users=PATTERN]`",
                n + 1
            ));
        };
        let users = match users {
            None => None,
            Some(u) => Some(
                u.strip_prefix("users=")
                    .ok_or_else(|| {
                        format!(
                            "line {}: after the role, only users=PATTERN may follow, not {:?}",
                            n + 1,
                            crate::limits::printable(u)
                        )
                    })
                    .and_then(UserPattern::parse)
                    .map_err(|e| {
                        if e.starts_with("line ") {
                            e
                        } else {
                            format!("line {}: {e}", n + 1)
                        }
                    })?,
            ),
        };
        let role = match role {
            None => Role::Operator,
            Some(r) => Role::parse(r).ok_or_else(|| {
                format!("line {}: the role {r:?} is not operator or submit", n + 1)
            })?,
        };
        crate::limits::check_text(op, "the operator", crate::limits::NAME_BYTES_MAX)
            .map_err(|e| format!("line {}: {}", n + 1, e.0))?;
        if token.len() < 16 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "line {}: a token must be at least 16 printable characters",
                n + 1
            ));
        }
        if users.is_some() && role != Role::Submit {
            return Err(format!(
                "line {}: users= limits a submit token; an operator's token acts for every user",
                n + 1
            ));
        }
        let who = Caller {
            name: op.to_string(),
            role,
            users,
        };
        if out.insert(token.to_string(), who).is_some() {
            return Err(format!("line {}: this token is already listed", n + 1));
        }
    }
    if out.is_empty() {
        return Err("the token file lists no `NAME TOKEN` line".into());
    }
    Ok(out)
}

/// Whether every address `listen` names is a loopback one.
pub fn is_loopback(listen: &str) -> bool {
    listen
        .to_socket_addrs()
        .map(|mut a| a.all(|s: SocketAddr| s.ip().is_loopback()))
        .unwrap_or(false)
        || listen
            .rsplit_once(':')
            .and_then(|(h, _)| h.trim_matches(['[', ']']).parse::<IpAddr>().ok())
            .is_some_and(|ip| ip.is_loopback())
}

/// The console's own checks of its inputs.
pub fn check_listen(listen: &str, tokens: bool) -> Result<(), String> {
    if !tokens && !is_loopback(listen) {
        return Err(format!(
            "{listen} is not a loopback address; listening elsewhere needs --token-file"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_and_addresses() {
        let t = read_tokens("# ops\nalice 0123456789abcdefXYZ\nbob  fedcba9876543210  # on call\n")
            .expect("valid");
        assert_eq!(
            t.get("0123456789abcdefXYZ").map(|c| c.name.as_str()),
            Some("alice")
        );
        assert_eq!(t.len(), 2);
        let r = read_tokens(
            "job 0123456789abcdefXYZ submit
ops fedcba9876543210 operator",
        )
        .expect("roles");
        assert_eq!(r["0123456789abcdefXYZ"].role, Role::Submit);
        assert_eq!(r["fedcba9876543210"].role, Role::Operator);
        assert!(read_tokens("x 0123456789abcdefXYZ admin").is_err());
        let scoped = read_tokens("job 0123456789abcdefXYZ submit users=cu_*").expect("scoped");
        let users = scoped["0123456789abcdefXYZ"]
            .users
            .as_ref()
            .expect("a pattern");
        assert!(users.admits("cu_ana") && !users.admits("ops"));
        let e = read_tokens("ops 0123456789abcdefXYZ operator users=cu_*").unwrap_err();
        assert!(e.contains("submit token"), "{e}");
        let e = read_tokens("job 0123456789abcdefXYZ submit cu_*").unwrap_err();
        assert!(e.contains("users=PATTERN"), "{e}");
        let hashed = read_tokens("ops 0123456789abcdef#xyz # the on-call").expect("a # in a token");
        assert!(hashed.contains_key("0123456789abcdef#xyz"));
        assert!(read_tokens("alice short").is_err());
        assert!(read_tokens("alice").is_err());
        assert!(read_tokens("").is_err());
        assert!(read_tokens("a 0123456789abcdef\nb 0123456789abcdef").is_err());
        assert!(is_loopback("127.0.0.1:8080"));
        assert!(is_loopback("[::1]:8080"));
        assert!(!is_loopback("0.0.0.0:8080"));
        assert!(check_listen("0.0.0.0:80", false).is_err());
        assert!(check_listen("0.0.0.0:80", true).is_ok());
    }
}
