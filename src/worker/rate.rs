//! A task's model calls under its profile's shared rate limit (`model::rate`): a reservation
//! before each call, settled with the tokens the provider reported; and, when the window
//! has no room or the provider answered `429`, the task yields: it goes back to the queue as
//! its last step left it, not to be claimed before capacity returns, and its thread is free.
//! The wait is not active time (only model and tool latency is).

use crate::kernel::{ModelReply, ModelRequest};
use crate::model::rate::{RateLimit, Reserve};

/// The limit of one run's model, and the state a yield gives back.
pub struct Capacity {
    pub key: String,
    pub limit: RateLimit,
    /// The reservation of the call in progress.
    pub reserved: Option<u64>,
}

/// What the limit says about the next call.
pub enum Gate {
    Go,
    /// Yield until this time.
    Wait(u64),
}

impl Capacity {
    pub fn new(rate: Option<(String, RateLimit)>) -> Option<Capacity> {
        rate.map(|(key, limit)| Capacity {
            key,
            limit,
            reserved: None,
        })
    }

    /// Reserves the call `req` asks for.
    pub fn before(
        &mut self,
        store: &dyn crate::store::Backend,
        req: &ModelRequest<'_>,
        now_ms: u64,
    ) -> crate::store::Result<Gate> {
        match store.reserve(&self.key, &self.limit, req.expected_tokens, now_ms)? {
            Reserve::Granted(id) => {
                self.reserved = Some(id);
                Ok(Gate::Go)
            }
            Reserve::WaitUntil(t) => {
                crate::metrics::global()
                    .rate_limited
                    .with_label_values(&[&self.key, "window"])
                    .inc();
                Ok(Gate::Wait(t))
            }
        }
    }

    /// Settles the call's reservation; a `busy` answer (the provider's `429`) drops it and
    /// slows the whole profile down for every daemon.
    pub fn after(
        &mut self,
        store: &dyn crate::store::Backend,
        reply: &ModelReply,
        busy_ms: Option<u64>,
        now_ms: u64,
    ) -> crate::store::Result<Gate> {
        let id = self.reserved.take();
        if let Some(wait) = busy_ms {
            if let Some(id) = id {
                store.settle_reservation(&self.key, id, None)?;
            }
            crate::metrics::global()
                .rate_limited
                .with_label_values(&[&self.key, "429"])
                .inc();
            let until = store.slow_down(&self.key, now_ms, wait)?;
            return Ok(Gate::Wait(until));
        }
        if let Some(id) = id {
            let used = reply
                .usage
                .as_ref()
                .map(|u| u.input_tokens + u.output_tokens);
            if let Some(t) = used {
                store.settle_reservation(&self.key, id, Some(t))?;
            }
        }
        Ok(Gate::Go)
    }
}
