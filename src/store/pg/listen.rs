//! The wake-ups of PostgreSQL: a thread with a connection of its own `LISTEN`s on a channel:
//! the ready channel that enqueue `NOTIFY`s (for idle daemons), the settled channel that a
//! trigger on the tasks' status notifies while someone is registered to listen (for whoever
//! waits for a task's result), or the callbacks channel a trigger on the outbox notifies.

use crossbeam_channel::{Receiver, bounded};
use postgres::fallible_iterator::FallibleIterator;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::PgStore;

impl PgStore {
    /// The receiving end of the wake-ups: a thread with its own connection `LISTEN`s on the
    /// ready channel and reconnects (with backoff, logged) when the connection is lost; after
    /// a reconnection it sends a wake-up too, since notifications may have been missed.
    pub(super) fn listen(&self) -> Option<Receiver<()>> {
        let mut guard = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rx) = guard.as_ref() {
            return Some(rx.clone());
        }
        let rx = self.listen_on(self.channel.clone(), None, Arc::clone(&self.stop))?;
        *guard = Some(rx.clone());
        Some(rx)
    }

    /// A thread that `LISTEN`s on `channel` (and then runs `then`, on the same session) until
    /// `stop` is set, reconnecting (with backoff, logged) when its connection is lost; after
    /// each connection it sends a wake-up, since notifications may have been missed.
    pub(super) fn listen_on(
        &self,
        channel: String,
        then: Option<String>,
        stop: Arc<AtomicBool>,
    ) -> Option<Receiver<()>> {
        let (tx, rx) = bounded::<()>(1);
        let settings = self.pool.settings.clone();
        let spawned = std::thread::Builder::new()
            .name("pg-listen".into())
            .spawn(move || {
                let mut delay = Duration::from_millis(100);
                loop {
                    let session = settings.connect().and_then(|mut c| {
                        c.batch_execute(&format!("LISTEN {channel}"))?;
                        if let Some(then) = &then {
                            c.batch_execute(then)?;
                        }
                        Ok(c)
                    });
                    let mut c = match session {
                        Ok(c) => c,
                        Err(e) => {
                            if stop.load(Ordering::Relaxed) {
                                return;
                            }
                            // Not listening: whoever waits reads again at each try.
                            let _ = tx.try_send(());
                            tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, channel = %channel, "cannot LISTEN; polling meanwhile");
                            std::thread::sleep(delay);
                            delay = (delay * 2).min(Duration::from_secs(5));
                            continue;
                        }
                    };
                    delay = Duration::from_millis(100);
                    let _ = tx.try_send(());
                    loop {
                        let next = c
                            .notifications()
                            .timeout_iter(Duration::from_secs(5))
                            .next();
                        match next {
                            Ok(Some(_)) => {
                                let _ = tx.try_send(());
                            }
                            Ok(None) => {
                                if stop.load(Ordering::Relaxed) {
                                    return;
                                }
                                // Quiet: a round trip proves the session is still there.
                                if c.simple_query("SELECT 1").is_err() {
                                    tracing::warn!("the LISTEN connection was lost; reconnecting");
                                    break;
                                }
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "the LISTEN connection was lost; reconnecting");
                                break;
                            }
                        }
                    }
                }
            });
        spawned.ok().map(|_| rx)
    }
}

/// Stops a `listen_on` thread when dropped (within its quiet interval).
pub(super) struct StopOnDrop(pub Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
