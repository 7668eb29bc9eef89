//! The `Tether-Approval` header: an operator's approval of one held call, made verifiable for
//! the tool service that receives the re-sent call.
//!
//! The approval itself lives in the worker database (who, when, which call). The daemon, when
//! it re-sends the approved call, signs it with the tool's approval secret (named by its
//! catalog entry, `approval_secret_env`, read from the daemon's environment):
//!
//! ```text
//! Tether-Approval: t=<expiry, Unix seconds>,d=<digest>,v1=<hex HMAC-SHA256>
//! signed text:     "<t>.<Idempotency-Key>.<user_id>.<call hash>"
//! call hash:       SHA-256 (all 64 hex digits) of json.dumps([tool, args], sort_keys=True)
//! digest:          its first 10 hex digits (what `worker show` prints and operators compare)
//! ```
//!
//! A service approves the call only if the digest of the call it received equals `d`, `t` is
//! not past, and the HMAC of the signed text (with the call hash and user id of the call it
//! received) under its secret equals `v1` (compared in constant time). The key and the user
//! are signed, so an approval cannot be carried over to another call or customer; the whole
//! hash is signed, not the 40-bit digest, so arguments cannot be searched for that share the
//! digest; the expiry bounds how long a captured header is worth anything. Anyone can compute
//! a digest; only the daemon and the service know the secret. `docs/approvals.md` has a
//! reference implementation for services (Python).

use hmac::{KeyInit, Mac};
use sha2::Sha256;

/// The header's name.
pub const HEADER: &str = "Tether-Approval";
/// How long a signed approval header is good for after it is sent.
pub const VALIDITY_S: u64 = 300;

/// The call an approval is for: its key, the user it runs for, and the whole hash of its tool
/// and arguments (`kernel::state::call_hash`).
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub key: &'a str,
    pub user: &'a str,
    pub hash: &'a str,
}

impl Call<'_> {
    fn digest(&self) -> &str {
        self.hash.get(..10).unwrap_or(self.hash)
    }
}

fn mac(secret: &[u8], t: u64, call: &Call<'_>) -> hmac::Hmac<Sha256> {
    // HMAC takes a key of any length.
    let mut m = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC-SHA256 accepts keys of any length"));
    m.update(format!("{t}.{}.{}.{}", call.key, call.user, call.hash).as_bytes());
    m
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The header value approving `call`, good until `expires_s`.
pub fn sign(secret: &[u8], call: &Call<'_>, expires_s: u64) -> String {
    let sig = mac(secret, expires_s, call).finalize().into_bytes();
    format!("t={expires_s},d={},v1={}", call.digest(), hex(&sig))
}

/// Whether `header` approves `call` (as the service computes it from the call it received)
/// at `now_s`. `Err` says why not.
pub fn verify(secret: &[u8], header: &str, call: &Call<'_>, now_s: u64) -> Result<(), String> {
    let (mut t, mut d, mut v1) = (None, None, None);
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<u64>().ok(),
            Some(("d", v)) => d = Some(v),
            Some(("v1", v)) => v1 = Some(v),
            _ => {}
        }
    }
    let (Some(t), Some(d), Some(v1)) = (t, d, v1) else {
        return Err("the approval is not of the form t=EXPIRY,d=DIGEST,v1=SIGNATURE".into());
    };
    if d != call.digest() {
        return Err(format!(
            "the approval is for digest {d}, and this call's digest is {}",
            call.digest()
        ));
    }
    if t < now_s {
        return Err("the approval has expired".into());
    }
    let sig: Option<Vec<u8>> = (v1.len() == 64)
        .then(|| {
            (0..32)
                .map(|i| u8::from_str_radix(v1.get(2 * i..2 * i + 2)?, 16).ok())
                .collect()
        })
        .flatten();
    let Some(sig) = sig else {
        return Err("the approval's signature is not 64 hex digits".into());
    };
    mac(secret, t, call).verify_slice(&sig).map_err(|_| {
        "the approval's signature does not match (another secret, key, user or call)".into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_approvals_verify_only_for_their_call_user_secret_and_time() {
        let hash = "54592ae224".to_string() + &"7".repeat(54);
        let call = Call {
            key: "db:t1:s2",
            user: "cu_ana",
            hash: &hash,
        };
        let h = sign(b"s3cret", &call, 1000);
        assert!(h.starts_with("t=1000,d=54592ae224,v1="), "{h}");
        assert_eq!(verify(b"s3cret", &h, &call, 999), Ok(()));
        assert_eq!(verify(b"s3cret", &h, &call, 1000), Ok(()));
        assert!(verify(b"s3cret", &h, &call, 1001).is_err());
        assert!(verify(b"other", &h, &call, 999).is_err());
        let other_key = Call {
            key: "db:t9:s2",
            ..call
        };
        assert!(verify(b"s3cret", &h, &other_key, 999).is_err());
        let other_user = Call {
            user: "cu_mallory",
            ..call
        };
        assert!(verify(b"s3cret", &h, &other_user, 999).is_err());
        // Another call with the same 10-digit digest: the whole hash is what is signed.
        let twin = "54592ae224".to_string() + &"8".repeat(54);
        let same_digest = Call {
            hash: &twin,
            ..call
        };
        assert!(verify(b"s3cret", &h, &same_digest, 999).is_err());
        // The digest alone (what anyone can compute) approves nothing.
        assert!(verify(b"s3cret", "54592ae224", &call, 999).is_err());
        // A later expiry is not the one signed.
        let moved = h.replace("t=1000", "t=9000");
        assert!(verify(b"s3cret", &moved, &call, 999).is_err());
    }

    /// RFC 4231, test case 2: HMAC-SHA256 of "what do ya want for nothing?" under "Jefe".
    #[test]
    fn hmac_is_rfc_4231() {
        let mut m = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(b"Jefe").expect("key");
        m.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&m.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
