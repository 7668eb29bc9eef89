//! The PostgreSQL backend: several daemons on several hosts share one queue in one database.
//!
//! Claims take ready tasks with `SELECT ... FOR UPDATE SKIP LOCKED` by priority and sequence;
//! every commit's `UPDATE` carries the claim's fencing token in its `WHERE`; a step commit is
//! one statement (the task row, its call record, reply and spans in data-modifying CTEs, which
//! write only if the fenced `UPDATE` matched); an enqueue or a requeue sends `NOTIFY`, which an
//! idle daemon `LISTEN`s for. Lease owners prove they are alive with heartbeats.
//!
//! A lost COMMIT acknowledgment is an unknown outcome, not a failure: every write transaction
//! (enqueues, decisions, notes, step commits) inserts a random commit marker into `commits`,
//! and after a connection drops during a commit the backend reconnects and inserts that marker
//! itself ([`PgStore::landed`]). The insert waits while the first transaction is still in
//! progress (a COMMIT waiting for a synchronous standby holds its marker), then either finds
//! the marker (the commit landed: the result stands) or inserts it, which also makes sure the
//! first transaction can never land afterwards (its marker would conflict): run again. A
//! commit still in progress when the retry time runs out is reported as not known, never run
//! again. Files: `pool` (connections, timeouts,
//! reconnection), `schema` (migrations), `rows` (a task as a row), `queue` (enqueue, claim,
//! recovery, heartbeats), `commit` (step commits and their read-back), `reads` (decisions,
//! reads, notes, purge, check).

mod callbacks;
mod commit;
mod decide;
mod flow;
mod list;
mod listen;
mod maintenance;
mod notes;
mod outbox;
pub(crate) use rows::random_i64;
mod pool;
mod queue;
mod rate;
mod reads;
pub mod rows;
mod schedules;
pub mod schema;
mod tls;

use crossbeam_channel::Receiver;
use postgres::Transaction;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use pool::{Conn, Pooled, db_error};
use pool::{Pool, Settings, is_connection_error};

use super::{Error, Result};

/// A Tether database in PostgreSQL: the worker schema (`tether` unless the URL's `schema`
/// parameter names another) and the demo shop schema beside it (`<schema>_store`).
pub struct PgStore {
    pool: Pool,
    schema: String,
    store_schema: String,
    db_id: String,
    /// The NOTIFY channel of this schema's ready queue.
    channel: String,
    wake: Mutex<Option<Receiver<()>>>,
    /// Wake-ups of this process's dispatcher after an enqueue or a decision made here.
    woken: crate::store::Woken,
    /// Tells the LISTEN thread to end when the store is dropped.
    stop: Arc<AtomicBool>,
    /// The step-commit statements by kind (intent, step, final, release, and a final commit
    /// that claims the next task), made once.
    commit_sql: [String; 10],
    /// Who this process is when it claims outbox entries to export (random).
    exporter: i64,
    /// Faults a test injects into step commits (the seeded simulation); none otherwise.
    commit_faults: Mutex<Option<FaultSource>>,
    /// The concurrency limits its claims apply.
    limits: std::sync::RwLock<Arc<crate::store::flow::ConcurrencyLimits>>,
}

/// What decides the fault of each step commit (see [`PgStore::inject_commit_faults`]).
type FaultSource = Box<dyn FnMut() -> CommitFault + Send>;

/// A fault injected into one step commit, for tests: the commit's acknowledgment is lost,
/// once the commit landed, or while its transaction is still in progress (it commits or
/// rolls back `resolve_after` later, as a COMMIT waiting for a synchronous standby would).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitFault {
    None,
    LostAck,
    InProgress {
        lands: bool,
        resolve_after: Duration,
    },
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The server's clock in milliseconds since the epoch, as SQL.
pub(crate) const SERVER_NOW_MS: &str = "(extract(epoch from now()) * 1000)::bigint";

/// "Now" in a statement whose parameter `$n` is the caller's clock offset (see [`offset_of`]):
/// the server's clock plus that offset. Leases, heartbeats, recovery and step-commit times are
/// stamped and compared with it, so that hosts whose clocks disagree agree on every expiry.
pub(crate) fn now_sql(n: u8) -> String {
    format!("({SERVER_NOW_MS} + ${n}::bigint)")
}

/// The clock of a caller that passed `now_ms`, as its offset from this process's wall clock:
/// about zero for a daemon, whose `now_ms` is its wall clock (so PostgreSQL's times are the
/// server's, whatever this host's clock says), and the lead of simulated time in the seeded
/// simulation (so its clock jumps move leases on PostgreSQL too).
pub(crate) fn offset_of(now_ms: u64) -> i64 {
    rows::i64_of(now_ms).saturating_sub(rows::now_i64())
}

/// Whether `db` names a PostgreSQL database (`postgres://...` or `postgresql://...`).
pub fn is_url(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://")
}

/// How long a daemon keeps reconnecting inside one operation before it reports the database
/// unavailable (it then logs and tries again at its next turn); a CLI verb gives up sooner.
pub const DAEMON_RETRY: Duration = Duration::from_secs(30);
pub const CLI_RETRY: Duration = Duration::from_secs(5);

/// The connection settings and schema of a URL: `schema=NAME` is Tether's own parameter;
/// the rest is libpq's URL syntax. Connect and statement timeouts are set unless given.
pub fn parse_url(url: &str, retry_for: Duration, max: usize) -> Result<(Settings, String)> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut schema = "tether".to_string();
    let (mut sslmode, mut sslrootcert) = (None, None);
    let mut rest = Vec::new();
    for part in query.split('&').filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some(("schema", v)) => schema = v.to_string(),
            // TLS is Tether's to set up (see `tls`): libpq's names, libpq's meaning.
            Some(("sslmode", v)) => sslmode = Some(crate::httpd::percent_decode(v)),
            Some(("sslrootcert", v)) => sslrootcert = Some(crate::httpd::percent_decode(v)),
            Some((k @ ("sslcert" | "sslkey" | "sslpassword" | "sslcrl"), _)) => {
                return Err(Error::Invalid(format!(
                    "{k} in the database URL: client certificates are not supported; authenticate with a password"
                )));
            }
            _ => rest.push(part),
        }
    }
    let (tls, ssl_mode) = tls::Connector::new(sslmode.as_deref(), sslrootcert.as_deref())?;
    let valid = !schema.is_empty()
        && schema.len() <= 40
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        return Err(Error::Invalid(format!(
            "schema {schema:?} in the database URL: use lower-case letters, digits and '_' (at most 40)"
        )));
    }
    let cleaned = if rest.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    let mut config = postgres::Config::from_str(&cleaned)
        .map_err(|e| Error::Invalid(format!("the database URL is not valid: {e}")))?;
    config.ssl_mode(ssl_mode);
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    if config.get_options().is_none() {
        // READ COMMITTED whatever the database's default: claims skip locked rows, and a settle
        // looks for registered waiters with a snapshot taken after it waited for their lock.
        config.options(
            "-c statement_timeout=30000 -c lock_timeout=10000 -c default_transaction_isolation=read\\ committed",
        );
    }
    if config.get_application_name().is_none() {
        config.application_name("tether");
    }
    // A cut connection is noticed within seconds, whether a request is outstanding or idle.
    config
        .tcp_user_timeout(Duration::from_secs(10))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(5))
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3);
    let display = display_of(&config);
    Ok((
        Settings {
            config,
            display,
            max: max.max(1),
            retry_for,
            tls,
        },
        schema,
    ))
}

/// `user@host:port/db`, never the password.
fn display_of(c: &postgres::Config) -> String {
    let host = c
        .get_hosts()
        .first()
        .map(|h| match h {
            postgres::config::Host::Tcp(s) => s.clone(),
            postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = c.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{host}:{port}/{}",
        c.get_user().unwrap_or("?"),
        c.get_dbname().unwrap_or("?")
    )
}

impl PgStore {
    /// Connects, and with `create` applies the migrations (under an advisory lock); without
    /// it, a database without Tether's schema is an error. `connections` sizes the pool.
    pub fn open(
        url: &str,
        create: bool,
        connections: usize,
        retry_for: Duration,
    ) -> Result<PgStore> {
        let (settings, schema) = parse_url(url, retry_for, connections)?;
        let store_schema = format!("{schema}_store");
        let pool = Pool::new(settings);
        let db_id = {
            let mut c = pool.get()?;
            let found = schema::version(&mut c.client, &schema)?;
            if found > schema::SCHEMA_VERSION {
                return Err(Error::NewerVersion {
                    what: format!("the PostgreSQL schema {schema}"),
                    found: found as u64,
                    supported: schema::SCHEMA_VERSION as u64,
                });
            }
            if found == 0 && !create {
                // As for a file that does not exist yet: `enqueue` or `run` creates it.
                return Err(Error::Missing(std::path::PathBuf::from(format!(
                    "postgres://{} (schema {schema})",
                    pool.settings.display
                ))));
            }
            if create || found < schema::SCHEMA_VERSION {
                schema::migrate(&mut c.client, &schema, &store_schema)?
            } else {
                c.client
                    .query_one(
                        &format!("SELECT value FROM {schema}.meta WHERE key = 'db_id'"),
                        &[],
                    )
                    .map_err(db_error)?
                    .get(0)
            }
        };
        let commit_sql = commit::commit_statements(&schema, &store_schema);
        Ok(PgStore {
            commit_sql,
            channel: format!("{schema}_ready"),
            pool,
            schema,
            store_schema,
            db_id,
            wake: Mutex::new(None),
            woken: Default::default(),
            stop: Arc::default(),
            exporter: random_i64(),
            commit_faults: Mutex::new(None),
            limits: Default::default(),
        })
    }

    /// For tests: `source` decides a fault for each step commit of a single task (not one
    /// that claims the next task), so that a seeded simulation meets lost acknowledgments and
    /// commits still in progress when their answer is lost.
    pub fn inject_commit_faults(&self, source: impl FnMut() -> CommitFault + Send + 'static) {
        if let Ok(mut f) = self.commit_faults.lock() {
            *f = Some(Box::new(source));
        }
    }

    fn next_commit_fault(&self) -> CommitFault {
        match self.commit_faults.lock() {
            Ok(mut f) => f.as_mut().map_or(CommitFault::None, |f| f()),
            Err(_) => CommitFault::None,
        }
    }

    /// Drops this database's schemas, the worker's and the store's, with everything in them.
    pub fn drop_schemas(&self) -> Result<()> {
        let sql = self.sql("DROP SCHEMA IF EXISTS {s} CASCADE; DROP SCHEMA IF EXISTS {t} CASCADE");
        self.read(|c| c.client.batch_execute(&sql))
    }

    /// The statement a claim without concurrency limits runs, with its parameters `$1`..`$6`
    /// (how many, the lease as JSON, its owner, its length in ms, the caller's clock offset,
    /// the claim's marker): for tests that look at its plan.
    #[doc(hidden)]
    pub fn claim_statement(&self) -> String {
        self.sql(&format!(
            "{}{}",
            queue::claim_sql(false),
            queue::returning("t.")
        ))
    }

    /// The statement of a final commit that claims the thread's next task (parameters as in
    /// `commit`'s `CommitParams`): for tests that look at its plan.
    #[doc(hidden)]
    pub fn final_claim_statement(&self) -> String {
        self.commit_sql[4].clone()
    }

    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Where the server is (no password), for messages.
    pub fn display(&self) -> &str {
        &self.pool.settings.display
    }

    /// The SQL of a template (`{s}`: the worker schema, `{t}`: the store schema).
    pub(crate) fn sql(&self, template: &str) -> String {
        schema::sql(template, &self.schema, &self.store_schema)
    }

    pub(crate) fn conn(&self) -> Result<Pooled<'_>> {
        self.pool.get()
    }

    /// Runs a read, reconnecting (with backoff) while the connection is lost.
    pub(crate) fn read<T>(
        &self,
        mut f: impl FnMut(&mut Conn) -> std::result::Result<T, postgres::Error>,
    ) -> Result<T> {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let mut c = self.pool.get()?;
            match f(&mut c) {
                Ok(v) => return Ok(v),
                Err(e) if is_connection_error(&e) => {
                    c.broken = true;
                    drop(c);
                    attempt += 1;
                    if !self.pool.backoff(started, attempt) {
                        return Err(db_error(e));
                    }
                }
                Err(e) => return Err(db_error(e)),
            }
        }
    }

    /// Runs one query with a statement prepared once per connection, reconnecting while the
    /// connection is lost.
    pub(crate) fn query(
        &self,
        sql: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>> {
        self.read(|c| {
            let st = c.prepared(sql)?;
            c.client.query(&st, params)
        })
    }

    /// Runs `f` in one transaction and commits it with a marker, so that a lost COMMIT
    /// acknowledgment is resolved by reading the marker back: landed, the result stands; not
    /// landed, `f` runs again. A connection lost before COMMIT is retried the same way.
    pub(crate) fn write<T>(
        &self,
        mut f: impl FnMut(&mut Transaction<'_>) -> Result<T>,
    ) -> Result<T> {
        let started = Instant::now();
        let mut attempt = 0;
        let marker_sql = self.sql(&format!(
            "INSERT INTO {{s}}.commits (id, at_ms) VALUES ($1, {SERVER_NOW_MS})"
        ));
        loop {
            let marker = random_i64();
            let mut c = self.pool.get()?;
            let tried = self.attempt(&mut c, marker, &marker_sql, &mut f);
            if !matches!(tried, Ok(Attempt::Done(_)) | Err(_)) {
                c.broken = true;
            }
            drop(c);
            match tried? {
                Attempt::Done(v) => return Ok(v),
                Attempt::Retry(e) => {
                    tracing::warn!(server = %self.display(), error = %e, "the connection was lost before COMMIT; running the transaction again");
                }
                Attempt::Unknown(v, e) => {
                    tracing::warn!(server = %self.display(), error = %e, "the connection was lost during COMMIT; reading back whether it landed");
                    if self.landed(marker)? {
                        tracing::info!("the commit had landed");
                        return Ok(v);
                    }
                    tracing::info!("the commit had not landed; running it again");
                }
            }
            attempt += 1;
            if !self.pool.backoff(started, attempt) {
                return Err(Error::Unavailable(format!(
                    "PostgreSQL at {} stayed unreachable",
                    self.display()
                )));
            }
        }
    }

    /// One try of [`PgStore::write`] on connection `c`.
    fn attempt<T>(
        &self,
        c: &mut Conn,
        marker: i64,
        marker_sql: &str,
        f: &mut impl FnMut(&mut Transaction<'_>) -> Result<T>,
    ) -> Result<Attempt<T>> {
        let mut tx = match c.client.transaction() {
            Ok(tx) => tx,
            Err(e) if is_connection_error(&e) => return Ok(Attempt::Retry(e.to_string())),
            Err(e) => return Err(db_error(e)),
        };
        let v = match f(&mut tx) {
            Ok(v) => v,
            Err(Error::Unavailable(m)) => return Ok(Attempt::Retry(m)),
            Err(e) => return Err(e),
        };
        match tx.execute(marker_sql, &[&marker]) {
            Ok(_) => {}
            Err(e) if is_connection_error(&e) => return Ok(Attempt::Retry(e.to_string())),
            Err(e) => return Err(db_error(e)),
        }
        match tx.commit() {
            Ok(()) => Ok(Attempt::Done(v)),
            Err(e) if is_connection_error(&e) => Ok(Attempt::Unknown(v, e.to_string())),
            Err(e) => Err(db_error(e)),
        }
    }

    /// Whether the transaction that inserts commit marker `marker` landed, after its COMMIT's
    /// acknowledgment was lost: exact, whatever that transaction is doing. Inserting the marker
    /// waits for a transaction still in progress (its uncommitted marker holds the key); then
    /// the marker is there (it landed) or this insert puts it there, marked with this
    /// read-back's nonce, after which that transaction can never land (its own insert would
    /// conflict). The marker read afterwards says which: a read-back whose own answer was lost
    /// (and that is retried) finds its nonce, never mistakes its marker for the commit's.
    /// While the transaction stays in progress (each wait ends at the `lock_timeout`), this
    /// keeps waiting up to the retry time, then says the outcome is not known: the caller must
    /// not run it again.
    pub(crate) fn landed(&self, marker: i64) -> Result<bool> {
        let insert = self.sql(&format!(
            "INSERT INTO {{s}}.commits (id, at_ms, read_back) VALUES ($1, {SERVER_NOW_MS}, $2) \
             ON CONFLICT (id) DO NOTHING"
        ));
        let check = self.sql("SELECT read_back FROM {s}.commits WHERE id = $1");
        let nonce = random_i64();
        let started = Instant::now();
        loop {
            let read = self.read(|c| {
                c.client.execute(&insert, &[&marker, &nonce])?;
                c.client.query_opt(&check, &[&marker])
            });
            match read {
                Ok(Some(row)) => return Ok(row.get::<_, Option<i64>>(0) != Some(nonce)),
                // Gone between the insert and the read (tidied): try again.
                Ok(None) => {}
                // 55P03: the lock timeout ran out while the transaction was still in progress.
                Err(Error::Postgres(m)) if m.starts_with("55P03") => {
                    tracing::warn!(server = %self.display(), "a commit whose acknowledgment was lost is still in progress (waiting for a synchronous standby?); waiting for its outcome");
                }
                Err(e) => return Err(e),
            }
            if started.elapsed() >= self.pool.settings.retry_for {
                return Err(Error::Unavailable(format!(
                    "the outcome of a commit is not known: its transaction is still in progress on {} (is a synchronous standby away?); it was not run again, and lands or not on its own",
                    self.display()
                )));
            }
        }
    }

    /// Tells idle daemons that a task may be ready (delivered when the transaction commits).
    pub(crate) fn notify(&self, tx: &mut Transaction<'_>) -> Result<()> {
        tx.execute("SELECT pg_notify($1, '')", &[&self.channel])
            .map_err(db_error)?;
        Ok(())
    }
}

/// How one try of a write transaction ended.
enum Attempt<T> {
    Done(T),
    /// The connection was lost before COMMIT was sent: nothing landed.
    Retry(String),
    /// The connection was lost during COMMIT: the result stands if the marker is found.
    Unknown(T, String),
}

impl crate::store::Backend for PgStore {
    fn db_id(&self) -> &str {
        &self.db_id
    }

    fn describe(&self) -> String {
        format!("PostgreSQL at {} (schema {})", self.display(), self.schema)
    }
}
