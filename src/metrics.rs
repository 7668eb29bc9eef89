//! Metrics in the Prometheus text format (the `prometheus` crate's registry and encoder), and
//! the `/metrics` and `/healthz` endpoints that `worker run --metrics` and the console serve.
//!
//! Two kinds of figures: what this process did (steps, commits and their latency and group
//! size, model and tool calls with latency and errors by name, lease takeovers), counted in
//! process-wide atomics as it happens; and what the database holds (tasks by status, held
//! writes, suspended calls, the oldest queued task's age), read from the backend's indexes at
//! each scrape, so two daemons and a console on one database report the same queue.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use crate::httpd::{Reply, Request};
use crate::store::Backend;

/// The process's metrics.
pub struct Metrics {
    registry: Registry,
    pub steps: IntCounter,
    pub commits: IntCounter,
    pub commit_seconds: Histogram,
    pub commit_group: Histogram,
    pub model_calls: IntCounterVec,
    pub model_seconds: HistogramVec,
    /// Model calls that waited for a shared rate limit, by limit and cause.
    pub rate_limited: IntCounterVec,
    pub tool_calls: IntCounterVec,
    pub tool_seconds: HistogramVec,
    pub tool_retries: IntCounterVec,
    pub takeovers: IntCounter,
    /// Tasks claimed, by what woke the dispatcher (the fallback poll should start none).
    pub claims_by: IntCounterVec,
    pub auto_settled: IntCounter,
    pub tasks_ended: IntCounterVec,
    /// Live OTLP export: spans sent, spans given up on, failed attempts.
    pub otlp_exported: IntCounter,
    pub otlp_dropped: IntCounter,
    pub otlp_failures: IntCounter,
    /// Completion callbacks: delivered, failed attempts (tried again), given up.
    pub callbacks_sent: IntCounter,
    pub callbacks_failed: IntCounter,
    pub callbacks_given_up: IntCounter,
    callbacks_pending: IntGauge,
    tasks: IntGaugeVec,
    held: IntGauge,
    suspended: IntGauge,
    oldest_queued: IntGauge,
    up: IntGauge,
}

const LATENCY: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

// Long: one declaration per metric, with its help text, as /metrics lists them; a table.
fn build() -> prometheus::Result<Metrics> {
    let registry = Registry::new();
    let counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
        let c = IntCounter::new(name, help)?;
        registry.register(Box::new(c.clone()))?;
        Ok(c)
    };
    let counters = |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<IntCounterVec> {
        let c = IntCounterVec::new(Opts::new(name, help), labels)?;
        registry.register(Box::new(c.clone()))?;
        Ok(c)
    };
    let histograms =
        |name: &str, help: &str, labels: &[&str]| -> prometheus::Result<HistogramVec> {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY.to_vec()),
                labels,
            )?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
    let gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
        let g = IntGauge::new(name, help)?;
        registry.register(Box::new(g.clone()))?;
        Ok(g)
    };
    let commit_seconds = Histogram::with_opts(
        HistogramOpts::new(
            "tether_commit_seconds",
            "Time to commit one group of step commits (one transaction).",
        )
        .buckets(LATENCY.to_vec()),
    )?;
    registry.register(Box::new(commit_seconds.clone()))?;
    let commit_group = Histogram::with_opts(
        HistogramOpts::new(
            "tether_commit_group_size",
            "Step commits grouped into one transaction.",
        )
        .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
    )?;
    registry.register(Box::new(commit_group.clone()))?;
    let tasks = IntGaugeVec::new(
        Opts::new("tether_tasks", "Tasks in the database by queue status."),
        &["status"],
    )?;
    registry.register(Box::new(tasks.clone()))?;
    Ok(Metrics {
        steps: counter(
            "tether_steps_total",
            "Steps committed by this process (each one transaction with its state).",
        )?,
        commits: counter(
            "tether_commits_total",
            "Commits (intents, steps, finals, releases) applied by this process.",
        )?,
        commit_seconds,
        commit_group,
        otlp_exported: counter(
            "tether_otlp_spans_exported_total",
            "Spans this process sent to the OTLP endpoint and the receiver accepted.",
        )?,
        otlp_dropped: counter(
            "tether_otlp_spans_dropped_total",
            "Spans given up on: refused by the receiver, whose task could not be read, or dropped from a full backlog.",
        )?,
        otlp_failures: counter(
            "tether_otlp_export_failures_total",
            "Export attempts that failed and will be retried (receiver down or erroring).",
        )?,
        callbacks_sent: counter(
            "tether_callbacks_sent_total",
            "Completion callbacks this process delivered (the receiver answered 2xx).",
        )?,
        callbacks_failed: counter(
            "tether_callbacks_failed_total",
            "Callback attempts that failed (receiver down, timed out or not 2xx); each is tried again until its retry window ends.",
        )?,
        callbacks_given_up: counter(
            "tether_callbacks_given_up_total",
            "Callbacks this process gave up on (retry window over, or a URL its config does not allow); each has a callback_failed audit event.",
        )?,
        callbacks_pending: gauge(
            "tether_callbacks_pending",
            "Completion callbacks waiting to be delivered.",
        )?,
        model_calls: counters(
            "tether_model_calls_total",
            "Model calls by model and outcome (ok, error, timeout).",
            &["model", "outcome"],
        )?,
        rate_limited: counters(
            "tether_rate_limit_waits_total",
            "Model calls a shared rate limit made wait (the task went back to the queue meanwhile), by limit and cause (window: no room in the window; 429: the provider asked to slow down).",
            &["limit", "cause"],
        )?,
        model_seconds: histograms(
            "tether_model_call_seconds",
            "Model call latency by model.",
            &["model"],
        )?,
        tool_calls: counters(
            "tether_tool_calls_total",
            "Tool calls by tool and outcome (the result's status: ok, error, unknown, ...).",
            &["tool", "outcome"],
        )?,
        tool_seconds: histograms(
            "tether_tool_call_seconds",
            "Tool call latency by tool.",
            &["tool"],
        )?,
        tool_retries: counters(
            "tether_tool_retries_total",
            "Tool calls sent again after a transient failure, by tool and what failed (http_503, timeout, ...); not counted in tether_tool_calls_total.",
            &["tool", "cause"],
        )?,
        takeovers: counter(
            "tether_lease_takeovers_total",
            "Tasks this process put back in the queue after their lease expired or their owner died.",
        )?,
        claims_by: counters(
            "tether_tasks_claimed_total",
            "Tasks this daemon claimed, by what led it to look: start (at start or right after a claim), enqueued (an enqueue or decision through this daemon), watch (a write seen by the watch on the file or by NOTIFY; the daemon's own writes show there too), run_ended, due (a delayed task, schedule or recovery time), poll (the fallback poll; a wake-up was missed).",
            &["by"],
        )?,
        auto_settled: counter(
            "tether_writes_settled_by_lookup_total",
            "Held writes this daemon settled by asking the tool's lookup_url (an operator settles the rest).",
        )?,
        tasks_ended: counters(
            "tether_tasks_ended_total",
            "Runs this process ended, by stop reason.",
            &["stop"],
        )?,
        tasks,
        held: gauge(
            "tether_held_writes",
            "Writes whose outcome is unknown, waiting for `worker reconcile` (cancelled tasks included).",
        )?,
        suspended: gauge(
            "tether_suspended_calls",
            "Tasks waiting on a person: for an approval of a call, or for an answer to a question.",
        )?,
        oldest_queued: gauge(
            "tether_oldest_queued_task_age_seconds",
            "Age of the oldest queued task (0 when none is queued).",
        )?,
        up: gauge(
            "tether_database_up",
            "1 when the last scrape could read the database, else 0.",
        )?,
        registry,
    })
}

/// This process's metrics.
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(|| build().expect("metric names and labels are fixed and valid"))
}

impl Metrics {
    /// Reads the database's figures into the gauges.
    fn refresh(&self, db: &dyn Backend) -> crate::store::Result<()> {
        let counts = db.counts()?;
        for (s, n) in &counts {
            self.tasks
                .with_label_values(&[s.as_str()])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let of = |s: crate::store::QueueStatus| counts.iter().find(|c| c.0 == s).map_or(0, |c| c.1);
        self.suspended
            .set(of(crate::store::QueueStatus::Suspended) as i64);
        self.held.set(db.held_ids()?.len() as i64);
        let age = db
            .oldest_queued_ms()?
            .map_or(0, |t| crate::clock::now_ms().saturating_sub(t) / 1000);
        self.oldest_queued.set(age as i64);
        self.callbacks_pending
            .set(i64::try_from(db.callbacks_pending()?).unwrap_or(i64::MAX));
        Ok(())
    }

    /// The text a scrape gets, with the database's figures as of now.
    pub fn render(&self, db: &dyn Backend) -> String {
        match self.refresh(db) {
            Ok(()) => self.up.set(1),
            Err(e) => {
                tracing::warn!(error = %e, "metrics: cannot read the database");
                self.up.set(0);
            }
        }
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "metrics: cannot encode");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// `/metrics` and `/healthz` for `db`; `None` for any other path.
pub fn handle(db: &dyn Backend, req: &Request) -> Option<Reply> {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/metrics") => Some(Reply::Response {
            status: 200,
            headers: vec![(
                "Content-Type",
                "text/plain; version=0.0.4; charset=utf-8".into(),
            )],
            body: global().render(db).into_bytes(),
        }),
        ("GET", "/healthz") => Some(match db.ready_count() {
            Ok(n) => Reply::json(200, &serde_json::json!({"status": "ok", "ready": n})),
            Err(e) => Reply::json(
                503,
                &serde_json::json!({"status": "unavailable", "error": e.to_string()}),
            ),
        }),
        _ => None,
    }
}

/// Serves `/metrics` and `/healthz` on `listen` in a thread until `stop` is set; returns the
/// bound address.
pub fn serve(listen: &str, db: Arc<dyn Backend>, stop: Arc<AtomicBool>) -> Result<String, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let listen = listen.to_string();
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let limits = crate::httpd::Limits {
                connections_max: 16,
                ..Default::default()
            };
            let ready = tx.clone();
            let result = crate::httpd::serve(
                &listen,
                limits,
                stop,
                move |addr| {
                    let _ = ready.send(Ok(addr));
                },
                Arc::new(move |req| {
                    handle(db.as_ref(), req).unwrap_or_else(|| {
                        Reply::json(
                            404,
                            &serde_json::json!({"error": "not found: try /metrics or /healthz"}),
                        )
                    })
                }),
            );
            if let Err(e) = result {
                let _ = tx.send(Err(e));
            }
        })
        .map_err(|e| format!("cannot start the metrics thread: {e}"))?;
    rx.recv()
        .map_err(|_| "the metrics server stopped before it listened".to_string())?
}
