//! Progress for long verbs, on a terminal only: a bar for a batch enqueue, and periodic rate
//! and remaining-count lines for `run --drain`. Piped or redirected, they print nothing (logs
//! and results stay clean); `WORKER_PROGRESS=always|never` overrides the terminal check.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::store::{Backend, QueueStatus};

/// Whether progress is shown: stderr is a terminal, unless `WORKER_PROGRESS` says otherwise.
pub fn enabled() -> bool {
    match std::env::var("WORKER_PROGRESS").as_deref() {
        Ok("always") => true,
        Ok("never") => false,
        _ => std::io::stderr().is_terminal(),
    }
}

/// A bar on one terminal line, redrawn at most ten times a second.
pub struct Bar {
    on: bool,
    label: String,
    total: u64,
    drawn: Option<Instant>,
}

impl Bar {
    pub fn new(label: &str, total: u64) -> Bar {
        Bar {
            on: enabled(),
            label: label.to_string(),
            total: total.max(1),
            drawn: None,
        }
    }

    pub fn set(&mut self, done: u64, note: &str) {
        if !self.on
            || self
                .drawn
                .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        let pct = (done.min(self.total) * 100 / self.total) as usize;
        let filled = pct * 30 / 100;
        let _ = write!(
            std::io::stderr(),
            "\r{} [{}{}] {pct:>3}% {note}\x1b[K",
            self.label,
            "#".repeat(filled),
            ".".repeat(30 - filled)
        );
    }

    /// Ends the bar's line with a last word.
    pub fn finish(&mut self, note: &str) {
        if self.on {
            self.drawn = None;
            self.set(self.total, note);
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// While a drain runs: every `every`, a line with the rate of ended runs and what is left.
pub fn drain_reporter(db: Arc<dyn Backend>, stop: Arc<AtomicBool>, every: Duration) {
    if !enabled() {
        return;
    }
    let settled = |db: &dyn Backend| -> Option<(u64, u64, u64)> {
        let c = db.counts().ok()?;
        let n = |s: QueueStatus| c.iter().find(|x| x.0 == s).map_or(0, |x| x.1);
        Some((
            n(QueueStatus::Finished) + n(QueueStatus::Suspended) + n(QueueStatus::Held),
            n(QueueStatus::Queued),
            n(QueueStatus::Running),
        ))
    };
    let _ = std::thread::Builder::new()
        .name("progress".into())
        .spawn(move || {
            let started = Instant::now();
            let Some((first, _, _)) = settled(db.as_ref()) else {
                return;
            };
            let mut next = started + every;
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
                if Instant::now() < next {
                    continue;
                }
                next += every;
                let Some((done, queued, running)) = settled(db.as_ref()) else {
                    continue;
                };
                let ended = done.saturating_sub(first);
                let rate = ended as f64 / started.elapsed().as_secs_f64().max(0.001);
                let left = queued + running;
                let eta = if rate > 0.0 {
                    format!(", about {:.0} s to go", left as f64 / rate)
                } else {
                    String::new()
                };
                eprintln!(
                    "drain: {ended} runs ended ({rate:.1}/s), {queued} queued, {running} running{eta}"
                );
            }
        });
}
