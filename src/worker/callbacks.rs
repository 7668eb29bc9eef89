//! The daemon's callback sender: a thread that delivers the completion callbacks waiting in
//! the outbox (`store::callbacks`), signed as Standard Webhooks specifies. Each attempt POSTs
//! the stored body with `webhook-id` (the same on every attempt), `webhook-timestamp` (seconds)
//! and `webhook-signature` (`v1,` and the base64 HMAC-SHA256 of `id.timestamp.body` under the
//! config's secret). A 2xx answer removes the callback; anything else (a receiver that is
//! down, an error status, a timeout) is tried again with a doubling backoff (1 s to 10 min,
//! jittered) until the config's `retry_for` has passed since the task settled, then given up
//! with an audit event. A URL this daemon's config does not allow is never sent to. The
//! thread sleeps on the database's wake-ups between passes, so a settled task's callback goes
//! out at once, and a receiver that is down costs the tasks nothing: they never wait for it.

use hmac::{KeyInit, Mac};
use sha2::Sha256;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::clock::now_ms;
use crate::config::callbacks::Callbacks as Settings;
use crate::store::prelude::*;
use crate::store::watch::Watch;
use crate::store::{Callback, Decision, Watched};

/// Callbacks claimed per pass.
const BATCH_MAX: usize = 16;
/// The longest wait between passes (retries fall due while nothing wakes the sender).
const IDLE_MAX: Duration = Duration::from_secs(2);
/// The longest backoff between two attempts of one callback.
const BACKOFF_MAX_MS: u64 = 600_000;
/// The most of a receiver's answer kept for the log and the audit event.
const ANSWER_BYTES_MAX: usize = 2_048;

/// The sender's part of the daemon.
pub struct Sender {
    store: Arc<dyn Backend>,
    settings: Settings,
    key: Vec<u8>,
    /// This sender's claims (never 0: 0 means unclaimed on the file).
    me: u64,
    owner: String,
    agent: ureq::Agent,
}

/// How one attempt went.
enum Attempt {
    Delivered,
    Failed(String),
}

impl Sender {
    pub fn new(store: Arc<dyn Backend>, settings: Settings, key: Vec<u8>, owner: String) -> Sender {
        let agent = crate::net::agent(Duration::from_millis(settings.timeout_ms));
        Sender {
            store,
            settings,
            key,
            me: crate::store::random_u64() | 1,
            owner,
            agent,
        }
    }

    /// Runs until `stop`; then one last pass over what is due, so a drain delivers what its
    /// tasks settled.
    pub fn run(&self, stop: &AtomicBool) {
        let watch = Watch::new(self.store.as_ref(), Watched::Callbacks);
        while !stop.load(Ordering::SeqCst) {
            let seen = watch.generation();
            let sent = self.pass();
            if sent == 0 {
                watch.wait(seen, Instant::now() + IDLE_MAX);
            }
        }
        self.pass();
        match self.store.callbacks_pending() {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                pending = n,
                "stopping with callbacks not yet delivered; the next daemon sends them"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot count the callbacks not yet delivered"),
        }
    }

    /// One pass: claims what is due and attempts each; how many were attempted.
    pub fn pass(&self) -> usize {
        let now = now_ms();
        // The claim outlasts the whole batch, every attempt at its timeout: another sender
        // never takes over a callback this one may still be sending.
        let claim_ms = self
            .settings
            .timeout_ms
            .saturating_mul(BATCH_MAX as u64 + 1)
            .saturating_add(5_000);
        let due = match self.store.callbacks_due(self.me, now, claim_ms, BATCH_MAX) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the callbacks to send; trying again");
                return 0;
            }
        };
        let n = due.len();
        for cb in due {
            self.deliver(&cb);
        }
        n
    }

    fn deliver(&self, cb: &Callback) {
        let m = crate::metrics::global();
        if let Err(why) = self.settings.check(&cb.url) {
            m.callbacks_given_up.inc();
            tracing::warn!(task = %cb.task_id, url = %cb.url, reason = %why, "callback not sent: this daemon's config does not allow its URL");
            self.give_up(cb, &why);
            return;
        }
        match self.attempt(cb) {
            Attempt::Delivered => {
                m.callbacks_sent.inc();
                tracing::info!(task = %cb.task_id, webhook_id = %cb.id, attempts = cb.attempts + 1, "callback delivered");
                if let Err(e) = self.store.callback_sent(cb.seq) {
                    // Sent again later, under the same id: the receiver deduplicates.
                    tracing::warn!(task = %cb.task_id, error = %e, "callback delivered, but not yet marked so; it may arrive again");
                }
            }
            Attempt::Failed(why) => {
                m.callbacks_failed.inc();
                let now = now_ms();
                let backoff = 1_000u64
                    .saturating_mul(1 << cb.attempts.min(20))
                    .min(BACKOFF_MAX_MS);
                let next = now.saturating_add(backoff / 2 + crate::net::jitter(backoff / 2));
                let window_ends = cb.created_at_ms.saturating_add(self.settings.retry_for_ms);
                if next > window_ends {
                    m.callbacks_given_up.inc();
                    // The audit event counts this last attempt too.
                    let last = Callback {
                        attempts: cb.attempts + 1,
                        last_error: Some(why.clone()),
                        ..cb.clone()
                    };
                    let why = format!(
                        "no receiver accepted it in {} attempts over the retry window ({}); last: {why}",
                        cb.attempts + 1,
                        crate::clock::duration_text(self.settings.retry_for_ms)
                    );
                    tracing::error!(task = %cb.task_id, url = %cb.url, reason = %why, "callback given up");
                    self.give_up(&last, &why);
                    return;
                }
                tracing::warn!(task = %cb.task_id, url = %cb.url, attempts = cb.attempts + 1, retry_in_ms = next - now, reason = %why, "callback failed; trying again");
                if let Err(e) = self.store.callback_retry(cb.seq, next, &why) {
                    tracing::warn!(task = %cb.task_id, error = %e, "cannot record the failed callback attempt");
                }
            }
        }
    }

    fn give_up(&self, cb: &Callback, why: &str) {
        let d = Decision {
            by: format!("daemon {}", self.owner),
            reason: Some("completion callback given up".into()),
            now_ms: now_ms(),
        };
        if let Err(e) = self.store.callback_give_up(cb, why, &d) {
            tracing::warn!(task = %cb.task_id, error = %e, "cannot record the callback given up");
        }
    }

    /// One POST of `cb`, signed now.
    fn attempt(&self, cb: &Callback) -> Attempt {
        let ts = now_ms() / 1000;
        let signature = sign(&self.key, &cb.id, ts, &cb.payload);
        let sent = self
            .agent
            .post(&cb.url)
            .header("content-type", "application/json")
            .header("user-agent", concat!("tether/", env!("CARGO_PKG_VERSION")))
            .header("webhook-id", &cb.id)
            .header("webhook-timestamp", &ts.to_string())
            .header("webhook-signature", &signature)
            .send(cb.payload.as_bytes());
        match sent {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                if (200..300).contains(&status) {
                    return Attempt::Delivered;
                }
                // The receiver's words go to this daemon's log only: the audit log (which a
                // task's submitter can read) gets the status, never the answer of a service
                // the callback may have reached.
                let body = crate::net::read_body(&mut resp, ANSWER_BYTES_MAX).unwrap_or_default();
                tracing::info!(task = %cb.task_id, status, answer = %crate::net::clip(&body), "callback refused by its receiver");
                Attempt::Failed(format!("HTTP {status}"))
            }
            Err(e) => Attempt::Failed(crate::net::clip(&e.to_string())),
        }
    }
}

/// The `webhook-signature` of a message: `v1,` and the base64 HMAC-SHA256 of
/// `{id}.{timestamp}.{body}` under `key` (Standard Webhooks).
pub fn sign(key: &[u8], id: &str, timestamp_s: u64, body: &str) -> String {
    use base64::Engine as _;
    let mut mac = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC-SHA256 accepts keys of any length"));
    mac.update(format!("{id}.{timestamp_s}.{body}").as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("v1,{sig}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification, signed as it signs it.
    #[test]
    fn the_signature_is_the_specifications() {
        let key = crate::config::callbacks::signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .expect("key");
        let sig = sign(
            &key,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
        );
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }
}
