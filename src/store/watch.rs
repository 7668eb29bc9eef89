//! Waiting for tasks to settle without polling: one [`Watch`] per process turns the backend's
//! wake-ups ([`Queue::changes`](super::Queue::changes)) into a generation number that any
//! number of waiters (the CLI's `wait`, the API's long polls) sleep on. A waiter reads the
//! generation, reads its task, and sleeps until the generation moves past what it read, so a
//! change between its read and its sleep is never missed. Where the backend has no wake-ups
//! the watch ticks on its own at [`POLL_FALLBACK`], and says so.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Backend, Watched};

/// How often waiters look again where the backend has no wake-ups.
pub const POLL_FALLBACK: Duration = Duration::from_millis(500);

/// A burst of changes (a busy daemon commits often) wakes waiters at most once per this.
const COALESCE: Duration = Duration::from_millis(20);

#[derive(Default)]
struct Shared {
    generation: Mutex<u64>,
    moved: Condvar,
}

/// The wake-ups of one database, shared by every waiter of this process.
#[derive(Clone)]
pub struct Watch {
    shared: Arc<Shared>,
    /// The backend gives wake-ups (else waiters poll).
    woken: bool,
}

impl Watch {
    /// Starts watching `db` for `of`: a thread forwards its wake-ups until the process ends.
    pub fn new(db: &dyn Backend, of: Watched) -> Watch {
        let shared = Arc::new(Shared::default());
        let Some(changes) = db.changes(of) else {
            return Watch {
                shared,
                woken: false,
            };
        };
        let to = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("settled-watch".into())
            .spawn(move || {
                let _guard = changes.guard;
                while changes.rx.recv().is_ok() {
                    to.bump();
                    std::thread::sleep(COALESCE);
                }
            });
        Watch {
            shared,
            woken: spawned.is_ok(),
        }
    }

    /// Whether waiters are woken by the database (true) or poll (false).
    pub fn is_woken(&self) -> bool {
        self.woken
    }

    /// The current generation: read it before reading what is waited for.
    pub fn generation(&self) -> u64 {
        *self
            .shared
            .generation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Sleeps until the generation moves past `seen` or `until` comes (or, without
    /// wake-ups, at most [`POLL_FALLBACK`]). Returns the generation then.
    pub fn wait(&self, seen: u64, until: Instant) -> u64 {
        let mut g = self
            .shared
            .generation
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let start = Instant::now();
        while *g == seen {
            let now = Instant::now();
            let mut left = until.saturating_duration_since(now);
            if !self.woken {
                left = left.min(POLL_FALLBACK.saturating_sub(now - start));
            }
            if left.is_zero() {
                break;
            }
            g = match self.shared.moved.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        *g
    }
}

impl Shared {
    fn bump(&self) {
        let mut g = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        *g = g.wrapping_add(1);
        self.moved.notify_all();
    }
}
