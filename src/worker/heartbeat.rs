//! The daemon's heartbeat on a shared database, in a thread of its own: it vouches for the
//! daemon's claims, and other daemons take over the claims of one whose heartbeat ran out. It
//! is not the dispatcher's to write, since the dispatcher may wait on the database for seconds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::now_ms;
use crate::store::{Backend, Error, Result};

/// The shortest heartbeat TTL a daemon accepts: its heartbeat thread beats every third of
/// the TTL, and one beat is a database write that a loaded server can delay.
pub const HEARTBEAT_TTL_MS_MIN: u64 = 3_000;

/// This daemon's heartbeat on a shared database, in a thread of its own (the dispatcher may
/// wait on the database for seconds): it beats every third of the TTL until stopped, and
/// keeps when its last beat was sent (monotonic), so the claims it vouches for are known to
/// hold until then plus the TTL.
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Milliseconds since `epoch` at which the last successful beat was sent.
    last_sent_ms: Arc<AtomicU64>,
    epoch: std::time::Instant,
    ttl_ms: u64,
}

impl Heartbeat {
    /// Beats once (an error if that fails: a daemon that cannot vouch for itself does not
    /// start), then every `ttl_ms / 3` in a thread.
    pub fn start(store: Arc<dyn Backend>, owner: String, ttl_ms: u64) -> Result<Heartbeat> {
        let epoch = std::time::Instant::now();
        let last_sent_ms = Arc::new(AtomicU64::new(0));
        let beat = {
            let (store, owner) = (Arc::clone(&store), owner.clone());
            move || {
                let now = now_ms();
                store.heartbeat(&owner, now, now.saturating_add(ttl_ms))
            }
        };
        beat()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = if store.local_owners() {
            // A file judges owners by their process: no beats needed.
            None
        } else {
            let (stop, last) = (Arc::clone(&stop), Arc::clone(&last_sent_ms));
            let every = Duration::from_millis(ttl_ms / 3);
            Some(
                std::thread::Builder::new()
                    .name("heartbeat".into())
                    .spawn(move || {
                        let mut next = std::time::Instant::now() + every;
                        while !stop.load(Ordering::SeqCst) {
                            let left = next.saturating_duration_since(std::time::Instant::now());
                            std::thread::sleep(left.min(Duration::from_millis(100)));
                            if std::time::Instant::now() < next {
                                continue;
                            }
                            next += every;
                            let sent = epoch.elapsed().as_millis() as u64;
                            match beat() {
                                Ok(()) => last.store(sent, Ordering::SeqCst),
                                Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
                            }
                        }
                    })
                    .map_err(|e| {
                        Error::Conflict(format!("cannot start the heartbeat thread: {e}"))
                    })?,
            )
        };
        Ok(Heartbeat {
            stop,
            thread,
            last_sent_ms,
            epoch,
            ttl_ms,
        })
    }

    /// How much longer the last beat vouches for this daemon's claims, by this process's
    /// monotonic clock (the beat was sent no earlier than it was recorded).
    pub fn left_ms(&self) -> u64 {
        let since = (self.epoch.elapsed().as_millis() as u64)
            .saturating_sub(self.last_sent_ms.load(Ordering::SeqCst));
        self.ttl_ms.saturating_sub(since)
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
