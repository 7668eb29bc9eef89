//! The daemon's heartbeat on a shared database, in a thread of its own: it vouches for the
//! daemon's claims, and other daemons take over the claims of one whose heartbeat ran out. It
//! is not the dispatcher's to write, since the dispatcher may wait on the database for seconds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::now_ms;
use crate::store::{Backend, Error, Result};

/// The shortest heartbeat TTL a daemon accepts: its heartbeat thread beats every third of
/// the TTL, and one beat is a database write that a loaded server can delay.
pub const HEARTBEAT_TTL_MS_MIN: u64 = 3_000;

/// This daemon's heartbeat on a shared database, in a thread of its own (the dispatcher may
/// wait on the database for seconds): it beats every third of the TTL until stopped. (Before
/// a write the driver asks the database how long the heartbeat has left:
/// `Backend::claim_left`.)
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    /// Beats once (an error if that fails: a daemon that cannot vouch for itself does not
    /// start), then every `ttl_ms / 3` in a thread.
    pub fn start(store: Arc<dyn Backend>, owner: String, ttl_ms: u64) -> Result<Heartbeat> {
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
            let stop = Arc::clone(&stop);
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
                            if let Err(e) = beat() {
                                tracing::warn!(error = %e, "heartbeat failed");
                            }
                        }
                    })
                    .map_err(|e| {
                        Error::Conflict(format!("cannot start the heartbeat thread: {e}"))
                    })?,
            )
        };
        Ok(Heartbeat { stop, thread })
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
