//! Live export: a thread of the daemon that sends committed spans to an OTLP/HTTP endpoint as
//! protobuf (`POST {endpoint}/v1/traces`, `application/x-protobuf`).
//!
//! Spans reach it through the database, not through memory: a commit of an exporting daemon
//! queues the spans it ended in the outbox, in the commit's own transaction
//! (`crate::store::outbox`). So a step that was not committed is never exported, a committed
//! one is exported even if the daemon is killed before sending it (the next daemon does), and
//! a span sent twice (sent, then killed before its entry was removed) carries the same ids.
//! The thread reads a bounded batch at a time, so its memory does not grow with a backlog; a
//! receiver that is down makes it retry with backoff (up to 30 s apart) while tasks go on; a
//! batch the receiver refuses as malformed (a 4xx other than 408 and 429) is dropped and
//! counted. Nothing here can block or fail a step.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::store::{Backend, OutboxEntry};

/// Outbox entries (commits) per request.
pub const BATCH: usize = 128;
const POLL: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How long a draining daemon keeps sending what is left before it exits (the rest waits in
/// the outbox for the next daemon).
pub const FLUSH_FOR: Duration = Duration::from_secs(10);

/// Where and how to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The traces URL: `{endpoint}/v1/traces`.
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    /// The most commits whose spans wait in the database for the receiver; past it the
    /// oldest are dropped (counted), so a receiver down for days cannot fill the disk.
    pub backlog_max: usize,
    /// The daemon's config, which resolves a task's model profile (its model and provider).
    pub config: Arc<crate::config::Config>,
}

/// The default of [`Target::backlog_max`]: about 50 MB of outbox.
pub const BACKLOG_MAX: usize = 1_000_000;

impl Target {
    /// From `--otlp-endpoint` (a base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`), else the
    /// OpenTelemetry SDKs' variables: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full traces
    /// URL), `OTEL_EXPORTER_OTLP_ENDPOINT`, and `OTEL_EXPORTER_OTLP_HEADERS` (`k=v,k2=v2`,
    /// values percent-encoded). `None`: export is off.
    pub fn configured(flag: Option<&str>) -> Result<Option<Target>, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        // A base endpoint gets /v1/traces added, so it may not end in a query.
        let base_url = |base: &str| {
            if base.contains('?') {
                return Err(format!(
                    "OTLP endpoint {:?} has a query: give the base URL, to which /v1/traces is added",
                    crate::limits::printable(base)
                ));
            }
            Ok(traces_url(base.trim()))
        };
        let url = match (flag, var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
            (Some(base), _) => base_url(base)?,
            (None, Some(full)) => full.trim().to_string(),
            (None, None) => match var("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Some(base) => base_url(&base)?,
                None => return Ok(None),
            },
        };
        crate::net::check_url(&url).map_err(|e| {
            format!("OTLP endpoint {e} (OTLP over HTTP, e.g. http://127.0.0.1:4318)")
        })?;
        let headers = match var("OTEL_EXPORTER_OTLP_HEADERS") {
            Some(h) => parse_headers(&h)?,
            None => Vec::new(),
        };
        Ok(Some(Target {
            url,
            headers,
            timeout: Duration::from_secs(10),
            backlog_max: BACKLOG_MAX,
            config: Arc::default(),
        }))
    }
}

fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// `k=v,k2=v2` with percent-encoded values, as the OpenTelemetry specification says.
pub fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for pair in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("OTEL_EXPORTER_OTLP_HEADERS: {pair:?} is not key=value"))?;
        let k = k.trim();
        if k.is_empty()
            || !k
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
        {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_HEADERS: {k:?} is not a header name"
            ));
        }
        out.push((k.to_string(), percent_decode(v.trim())?));
    }
    Ok(out)
}

fn percent_decode(v: &str) -> Result<String, String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = v
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("OTEL_EXPORTER_OTLP_HEADERS: bad escape in {v:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("OTEL_EXPORTER_OTLP_HEADERS: {v:?} is not UTF-8"))
}

/// What one attempt to send a batch came to.
enum Sent {
    /// Accepted (the receiver may have rejected some spans: counted).
    Accepted,
    /// Refused as malformed: sending it again would not help.
    Refused(String),
    /// Not delivered (down, timeout, 5xx, 408, 429): retry later.
    Failed(String),
}

fn send(agent: &ureq::Agent, t: &Target, body: &[u8]) -> Sent {
    let mut r = agent
        .post(&t.url)
        .header("Content-Type", "application/x-protobuf");
    for (k, v) in &t.headers {
        r = r.header(k.as_str(), v.as_str());
    }
    match r.send(body) {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            let body = resp
                .body_mut()
                .with_config()
                .limit(64 * 1024)
                .read_to_vec()
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&body);
            match status {
                200..=299 => {
                    if let Some((n, why)) = super::proto::rejected(&body) {
                        crate::metrics::global()
                            .otlp_dropped
                            .inc_by(n.max(0) as u64);
                        tracing::warn!(rejected = n, error = %why, "the OTLP receiver rejected some spans");
                    }
                    Sent::Accepted
                }
                408 | 429 => Sent::Failed(format!("HTTP {status}")),
                400..=499 => Sent::Refused(format!("HTTP {status}: {}", crate::net::clip(&text))),
                _ => Sent::Failed(format!("HTTP {status}: {}", crate::net::clip(&text))),
            }
        }
        Err(e) => Sent::Failed(e.to_string()),
    }
}

/// The spans of `entries`, read from the database, as one encoded request. Entries whose task
/// or spans cannot be read are counted as dropped (and removed with the batch).
fn batch(store: &dyn Backend, entries: &[OutboxEntry], t: &Target) -> (Vec<u8>, usize) {
    let db = store.db_id();
    let mut out = Vec::new();
    let mut tasks: Vec<&str> = entries.iter().map(|e| e.task_id.as_str()).collect();
    tasks.sort_unstable();
    tasks.dedup();
    for task in tasks {
        let wanted: std::collections::BTreeSet<u32> = entries
            .iter()
            .filter(|e| e.task_id == task)
            .flat_map(|e| e.spans.iter().copied())
            .collect();
        let read = store.task(task).and_then(|rec| {
            let spans = store.spans(task)?;
            let replies = store.replies(task)?;
            Ok((rec, spans, replies))
        });
        match read {
            Ok((rec, spans, replies)) => {
                let model = t.config.model_for(&rec.model).ok();
                let http = model.as_ref().and_then(crate::model::RunModel::http);
                if wanted.contains(&super::ROOT) {
                    out.push(super::root_of(db, &rec, &spans));
                }
                out.extend(super::spans_of(db, &rec, &spans, &replies, http, |id| {
                    wanted.contains(&id)
                }));
            }
            Err(e) => {
                crate::metrics::global()
                    .otlp_dropped
                    .inc_by(wanted.len() as u64);
                tracing::warn!(task, error = %e, spans = wanted.len(), "spans not exported: the task cannot be read");
            }
        }
    }
    let n = out.len();
    (super::proto::request(&super::resource(db), &out), n)
}

/// Keeps the backlog within `keep` commits: drops the oldest, counted and logged.
fn trim(store: &dyn Backend, keep: usize) {
    match store.outbox_trim(keep) {
        Ok((0, _)) => {}
        Ok((entries, spans)) => {
            crate::metrics::global().otlp_dropped.inc_by(spans);
            tracing::warn!(
                entries,
                spans,
                keep,
                "the span backlog is full; dropped its oldest spans"
            );
        }
        Err(e) => tracing::warn!(error = %e, "cannot trim the span outbox"),
    }
}

/// Sleeps `d`, or less if `stop` is set.
fn nap(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while Instant::now() < until && !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
    }
}

/// The export thread. Dropping it stops it: it keeps sending what the outbox holds for at
/// most [`FLUSH_FOR`] (while the receiver accepts), then ends, and the drop waits for that.
pub struct Exporter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Exporter {
    pub fn start(store: Arc<dyn Backend>, target: Target) -> std::io::Result<Exporter> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || run(store.as_ref(), &target, &flag))?;
        Ok(Exporter {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(store: &dyn Backend, t: &Target, stop: &AtomicBool) {
    send_until_stopped(store, t, stop);
    // What this exporter claimed and did not send goes to the next one at once.
    if let Err(e) = store.outbox_release() {
        tracing::debug!(error = %e, "cannot release the outbox claims; they run out in a minute");
    }
}

fn send_until_stopped(store: &dyn Backend, t: &Target, stop: &AtomicBool) {
    let m = crate::metrics::global();
    let agent = crate::net::agent(t.timeout);
    let mut backoff = Duration::ZERO;
    let mut failing_since: Option<Instant> = None;
    let mut flush_until: Option<Instant> = None;
    let mut backlog = false;
    let mut pending: Option<(Vec<u64>, Vec<u8>, usize)> = None;
    loop {
        if stop.load(Ordering::SeqCst) {
            let until = *flush_until.get_or_insert_with(|| Instant::now() + FLUSH_FOR);
            if Instant::now() >= until || failing_since.is_some() {
                break;
            }
        }
        // A backlog (a receiver that is down, or slower than the steps): keep it bounded.
        if backlog || failing_since.is_some() {
            trim(store, t.backlog_max);
        }
        let entries = match store.outbox(BATCH) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the span outbox; trying again");
                nap(Duration::from_secs(1), stop);
                continue;
            }
        };
        backlog = entries.len() == BATCH;
        if entries.is_empty() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            nap(POLL, stop);
            continue;
        }
        let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
        // A retry of the same entries sends the request already built (a receiver that is
        // down costs no reads of the tasks and no encoding per attempt).
        let (body, spans) = match pending.take() {
            Some((s, body, spans)) if s == seqs => (body, spans),
            _ => batch(store, &entries, t),
        };
        let sent = send(&agent, t, &body);
        if matches!(sent, Sent::Failed(_)) {
            pending = Some((seqs.clone(), body, spans));
        }
        match sent {
            Sent::Accepted => {
                m.otlp_exported.inc_by(spans as u64);
                if let Some(since) = failing_since.take() {
                    tracing::info!(url = %t.url, down_s = since.elapsed().as_secs(), "the OTLP receiver accepts spans again");
                }
                backoff = Duration::ZERO;
                if let Err(e) = store.outbox_done(&seqs) {
                    // They will be sent again, with the same ids.
                    tracing::warn!(error = %e, "cannot remove exported spans from the outbox");
                }
            }
            Sent::Refused(why) => {
                m.otlp_dropped.inc_by(spans as u64);
                tracing::error!(url = %t.url, spans, error = %why, "the OTLP receiver refused a batch; dropped");
                let _ = store.outbox_done(&seqs);
            }
            Sent::Failed(why) => {
                m.otlp_failures.inc();
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::warn!(url = %t.url, error = %why, "cannot send spans to the OTLP receiver; retrying with backoff (tasks go on)");
                } else {
                    tracing::debug!(url = %t.url, error = %why, "OTLP export still failing");
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(250), BACKOFF_MAX);
                nap(backoff, stop);
            }
        }
    }
}
