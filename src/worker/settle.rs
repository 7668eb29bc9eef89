//! The daemon settling held writes by itself: a write held because its outcome is unknown (a
//! crash or a lost answer between sending it and recording its answer) is looked up at its
//! tool's `lookup_url`, the same question `worker reconcile --auto` asks, and settled when the
//! lookup answers definitely, audited under the daemon's identity. What the lookup cannot
//! answer stays held for an operator and is asked again later, with backoff.
//!
//! Only HTTP tools that this daemon's own catalog gives a `lookup_url` (and does not switch
//! off with `auto_settle = false`) are asked: never a URL a task stored, and never the demo
//! shop, whose held writes are an operator's to settle. A write is asked about only once the
//! send it was held after has timed out, and a lookup's "not applied" is believed only
//! `lookup_grace_ms` (default 60 s) after the send: a slow service may still be doing the work,
//! and re-sending then would do it twice. A key the daemon settled as not applied once is not
//! settled by it again: the re-send was held again, so the lookup and the service disagree, and
//! that is a person's to look at.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::kernel::ToolCall;
use crate::operator::{decision, settle_by_lookup};
use crate::store::{Backend, CallRecord, Error, TaskRecord};

/// The first wait after a lookup that gave no definite answer; it doubles up to the most.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MOST: Duration = Duration::from_secs(300);

/// Why the daemon settled a write, in the audit log.
pub const REASON: &str = "settled by the daemon: the tool's lookup_url answered for the key";

pub struct Settler {
    /// Who decides, in the audit log: `daemon HOST:PID:...`.
    by: String,
    /// Per call key: when to ask again, and the wait after that.
    waits: Mutex<HashMap<String, (Instant, Duration)>>,
    /// Keys a daemon settled as not applied once already: left to an operator.
    given_up: Mutex<HashSet<String>>,
}

/// Whether a daemon settled `key` as not applied before: its re-send was held again, so the
/// lookup and the service disagree, and a person decides (asking again would re-send it
/// again and again). Read from the audit log, so it holds across restarts.
fn gave_up(
    store: &dyn Backend,
    cache: Option<&mut HashSet<String>>,
    rec: &TaskRecord,
    key: &str,
) -> bool {
    let Some(cache) = cache else { return true };
    if cache.contains(key) {
        return true;
    }
    let before = store.events(Some(&rec.id)).is_ok_and(|events| {
        events.iter().any(|e| {
            e.verb == "reconcile_not_applied"
                && e.by.starts_with("daemon ")
                && e.detail["key"].as_str() == Some(key)
        })
    });
    if before {
        tracing::warn!(task = %rec.id, key, "the lookup said this write was not applied once already, and its re-send was held again: it is left for an operator (worker reconcile)");
        cache.insert(key.to_string());
    }
    before
}

/// How long after its intent the send of a write to `t` (an HTTP tool) may still be in
/// flight: each try's timeout and the longest wait between tries (only an idempotent write is
/// tried more than once). A lookup before then could miss a write about to land.
fn in_flight_ms(t: &crate::kernel::ToolSpec, h: &crate::kernel::catalog::HttpSpec) -> u64 {
    let tries = if t.idempotent {
        h.retry.attempts.max(1)
    } else {
        1
    };
    let waits_ms = h
        .retry
        .max_backoff_ms
        .saturating_mul(u64::from(tries.saturating_sub(1)));
    h.timeout_ms
        .saturating_mul(u64::from(tries))
        .saturating_add(waits_ms)
}

impl Settler {
    pub fn new(owner: &str) -> Settler {
        Settler {
            by: format!("daemon {owner}"),
            waits: Mutex::default(),
            given_up: Mutex::default(),
        }
    }

    /// Asks the lookup of every held write that is due; returns how many were settled.
    pub fn pass(&self, store: &dyn Backend, config: &Config) -> usize {
        let Ok(mut waits) = self.waits.lock() else {
            return 0;
        };
        let d = match decision(&self.by, Some(REASON)) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "cannot settle held writes");
                return 0;
            }
        };
        let now = Instant::now();
        let now_ms = crate::clock::now_ms();
        let mut given_up = self.given_up.lock().ok();
        let mut select = |rec: &TaskRecord, call: &ToolCall, key: &str, c: Option<&CallRecord>| {
            let (t, h) = config
                .catalog
                .as_ref()
                .and_then(|cat| cat.get(&call.name))
                .and_then(|t| Some((t, t.http.as_ref()?)))?;
            let in_flight_ms = in_flight_ms(t, h);
            let sent_ms_ago = c.map_or(u64::MAX, |c| now_ms.saturating_sub(c.intent_at_ms));
            // Only a write the task sent to an HTTP tool: its catalog may route a tool of the
            // same name elsewhere (an MCP server, the demo shop), which this lookup knows
            // nothing of.
            let picked = rec
                .catalog
                .as_ref()
                .and_then(|cat| cat.get(&call.name))
                .is_some_and(|s| matches!(s.route(), crate::kernel::Route::Http(_)))
                && config.auto_settle_url(&call.name).is_some()
                && sent_ms_ago >= in_flight_ms
                && waits.get(key).is_none_or(|(at, _)| *at <= now)
                && !gave_up(store, given_up.as_deref_mut(), rec, key);
            picked.then_some(sent_ms_ago >= h.lookup_grace_ms.max(in_flight_ms))
        };
        let mut no_demo = || {
            Err(Error::Invalid(
                "the daemon does not settle the demo shop's writes".into(),
            ))
        };
        let rows = match settle_by_lookup(store, config, &mut no_demo, &d, &mut select) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the held writes to settle them");
                return 0;
            }
        };
        let mut settled = 0;
        for r in rows {
            if r.outcome == "left_held" {
                let wait = waits.get(&r.key).map_or(RETRY_FIRST, |(_, w)| *w);
                waits.insert(r.key.clone(), (now + wait, (wait * 2).min(RETRY_MOST)));
                tracing::warn!(task = %r.task, tool = %r.tool, key = %r.key,
                    why = r.why.as_deref().unwrap_or("no answer"), retry_in_s = wait.as_secs(),
                    "a held write's lookup gave no definite answer; it stays held");
            } else {
                waits.remove(&r.key);
                settled += 1;
                crate::metrics::global().auto_settled.inc();
                tracing::info!(task = %r.task, tool = %r.tool, key = %r.key, outcome = r.outcome,
                    "settled a held write by its tool's lookup");
            }
        }
        settled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review 48: the window counted each try's timeout but not the waits between tries, so a
    /// lookup could come while a retry was still to be sent.
    #[test]
    fn the_in_flight_window_counts_the_waits_between_tries() {
        let catalog = crate::config::parse_catalog(
            "version = 1\n[[tools]]\nname = \"set_status\"\naccess = \"write\"\nidempotent = true\n\
             http = { url = \"http://127.0.0.1:9/s\", timeout_ms = 1000, retry = { attempts = 3, backoff_ms = 100, max_backoff_ms = 4000 } }\n\
             [[tools]]\nname = \"add_note\"\naccess = \"write\"\n\
             http = { url = \"http://127.0.0.1:9/n\", timeout_ms = 1000, retry = { attempts = 3, backoff_ms = 100, max_backoff_ms = 4000 } }\n",
            std::path::Path::new("tools.toml"),
        )
        .expect("a catalog");
        let window = |name: &str| {
            let t = catalog.get(name).expect("a tool");
            in_flight_ms(t, t.http.as_ref().expect("http"))
        };
        assert_eq!(window("set_status"), 3 * 1000 + 2 * 4000);
        assert_eq!(window("add_note"), 1000, "sent once");
    }
}
