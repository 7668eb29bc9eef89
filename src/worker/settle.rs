//! The daemon settling held writes by itself: a write held because its outcome is unknown (a
//! crash or a lost answer between sending it and recording its answer) is looked up at its
//! tool's `lookup_url`, the same question `worker reconcile --auto` asks, and settled when the
//! lookup answers definitely, audited under the daemon's identity. What the lookup cannot
//! answer stays held for an operator and is asked again later, with backoff.
//!
//! Only HTTP tools that this daemon's own catalog gives a `lookup_url` (and does not switch
//! off with `auto_settle = false`) are asked: never a URL a task stored, and never the demo
//! shop, whose held writes are an operator's to settle.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::operator::{decision, settle_by_lookup};
use crate::store::{Backend, Error};

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
}

impl Settler {
    pub fn new(owner: &str) -> Settler {
        Settler {
            by: format!("daemon {owner}"),
            waits: Mutex::default(),
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
        let mut select =
            |rec: &crate::store::TaskRecord, call: &crate::kernel::ToolCall, key: &str| {
                rec.catalog
                    .as_ref()
                    .is_some_and(|c| c.get(&call.name).is_some())
                    && config.auto_settle_url(&call.name).is_some()
                    && waits.get(key).is_none_or(|(at, _)| *at <= now)
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
