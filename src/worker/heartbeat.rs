//! The daemon's heartbeat on a shared database, in a thread of its own: it vouches for the
//! daemon's claims, and other daemons take over the claims of one whose heartbeat ran out. It
//! is not the dispatcher's to write, since the dispatcher may wait on the database for seconds.

use crossbeam_channel::{RecvTimeoutError, Sender, bounded};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Dropped to stop the thread: its wait between beats ends at once, so a daemon's
    /// shutdown does not wait out a sleep.
    stop: Option<Sender<()>>,
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
        let (stop, stopped) = bounded::<()>(0);
        let thread = if store.local_owners() {
            // A file judges owners by their process: no beats needed.
            None
        } else {
            let every = Duration::from_millis(ttl_ms / 3);
            Some(
                std::thread::Builder::new()
                    .name("heartbeat".into())
                    .spawn(move || {
                        // Nothing is ever sent: the wait ends with a beat due or with the
                        // sender dropped (`Disconnected`). Beats keep their schedule (one
                        // every third of the TTL from the start), however long each took.
                        let mut next = Instant::now() + every;
                        while let Err(RecvTimeoutError::Timeout) =
                            stopped.recv_timeout(next.saturating_duration_since(Instant::now()))
                        {
                            if let Err(e) = beat() {
                                tracing::warn!(error = %e, "heartbeat failed");
                            }
                            // After beats that took longer than the interval, one more is
                            // due at once, not every one the schedule missed.
                            next = (next + every).max(Instant::now());
                        }
                    })
                    .map_err(|e| {
                        Error::Conflict(format!("cannot start the heartbeat thread: {e}"))
                    })?,
            )
        };
        Ok(Heartbeat {
            stop: Some(stop),
            thread,
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
