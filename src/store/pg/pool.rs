//! Connections to PostgreSQL: a bounded pool (sized to the daemon's threads), timeouts on
//! connect and on every statement, reconnection with backoff that says so in the logs, and the
//! rule that tells a lost connection (the outcome of an in-flight COMMIT is unknown) from an
//! error the server answered (nothing was written).

use postgres::{Client, Config, Statement};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::store::{Error, Result};

/// How to reach the server, and for how long to keep trying.
#[derive(Clone, Debug)]
pub struct Settings {
    pub config: Config,
    /// Where the server is, for messages (never the password).
    pub display: String,
    /// Most connections open at once.
    pub max: usize,
    /// How long an operation keeps reconnecting before it gives up with `Unavailable`.
    pub retry_for: Duration,
    /// TLS, as the URL's `sslmode` and `sslrootcert` say.
    pub tls: super::tls::Connector,
}

impl Settings {
    /// A new connection (outside the pool).
    pub fn connect(&self) -> std::result::Result<Client, postgres::Error> {
        self.config.connect(self.tls.clone())
    }
}

/// What a PostgreSQL error says, with the server's own words: its severity, SQLSTATE,
/// message, detail and hint when the server answered, else the client's error and its cause
/// (`postgres::Error` prints only "db error" or "error performing TLS handshake").
pub fn describe(e: &postgres::Error) -> String {
    if let Some(d) = e.as_db_error() {
        let mut out = format!("{} {}: {}", d.severity(), d.code().code(), d.message());
        if let Some(detail) = d.detail() {
            out.push_str(&format!(" (detail: {detail})"));
        }
        if let Some(hint) = d.hint() {
            out.push_str(&format!(" (hint: {hint})"));
        }
        return out;
    }
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push_str(&format!(": {c}"));
        cause = c.source();
    }
    out
}

/// One connection with the statements prepared on it.
pub struct Conn {
    pub client: Client,
    prepared: HashMap<String, Statement>,
    /// Set when the connection failed: it is dropped instead of returned to the pool.
    pub broken: bool,
    /// The server process serving it and when that started (which tells it apart from a
    /// later process given the same id): read at connect, so that a session whose
    /// connection was lost can be ended before anyone looks at what it did.
    pub session: Option<(i32, String)>,
}

impl Conn {
    /// The statement for `sql`, prepared once per connection (a hot statement then costs one
    /// round trip instead of two).
    pub fn prepared(&mut self, sql: &str) -> std::result::Result<Statement, postgres::Error> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql)?;
        self.prepared.insert(sql.to_string(), s.clone());
        Ok(s)
    }
}

pub struct Pool {
    pub settings: Settings,
    idle: Mutex<PoolState>,
    freed: Condvar,
}

#[derive(Default)]
struct PoolState {
    idle: Vec<Conn>,
    open: usize,
    /// The server was unreachable: the next success is logged as a reconnection.
    down: bool,
}

/// A connection taken from the pool; returned to it when dropped, unless broken.
pub struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Conn>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn
            .as_ref()
            .expect("a pooled connection is present until dropped")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn
            .as_mut()
            .expect("a pooled connection is present until dropped")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        let mut st = self.pool.lock();
        if conn.broken || conn.client.is_closed() {
            st.open = st.open.saturating_sub(1);
        } else {
            st.idle.push(conn);
        }
        drop(st);
        self.pool.freed.notify_one();
    }
}

/// Whether `e` means the connection is gone (so an in-flight COMMIT may or may not have
/// landed), as opposed to an error the server answered.
pub fn is_connection_error(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(code) = e.code() {
        let c = code.code();
        // Class 08: connection exception; 57P01-57P03: the server is shutting down or
        // starting up.
        return c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03");
    }
    // No SQLSTATE: an I/O or protocol error on the socket.
    e.as_db_error().is_none()
}

/// A PostgreSQL error as a store error: a lost connection is `Unavailable`.
pub fn db_error(e: postgres::Error) -> Error {
    if is_connection_error(&e) {
        Error::Unavailable(describe(&e))
    } else {
        // The SQLSTATE first: callers tell errors apart by it (23505, 55P03, ...).
        let msg = match e.as_db_error() {
            Some(d) => {
                let mut m = format!("{}: {}", d.code().code(), d.message());
                if let Some(detail) = d.detail() {
                    m.push_str(&format!(" (detail: {detail})"));
                }
                if let Some(hint) = d.hint() {
                    m.push_str(&format!(" (hint: {hint})"));
                }
                m
            }
            None => describe(&e),
        };
        Error::Postgres(msg)
    }
}

/// Why a failed connect will fail again however often it is tried, if it will: the server
/// refused it (authentication, a role or database that does not exist), or TLS cannot be had
/// (the server does not offer it, or its certificate is not the one the URL trusts). A
/// connection dropped during the handshake, a server starting up or too busy are worth
/// waiting for.
fn refused_at_connect(e: &postgres::Error, display: &str) -> Option<String> {
    let why = describe(e);
    match e.code().map(|c| c.code()) {
        Some("57P01" | "57P02" | "57P03" | "53300") => None,
        Some(_) => Some(format!(
            "the PostgreSQL server at {display} refused the connection: {why}"
        )),
        None if why.contains("invalid peer certificate") => Some(format!(
            "the certificate of the PostgreSQL server at {display} is not one the URL's sslmode and sslrootcert accept: {why}"
        )),
        None if why.contains("does not support TLS") => Some(format!(
            "the PostgreSQL server at {display} does not offer TLS, which the URL's sslmode requires: {why}"
        )),
        None => None,
    }
}

impl Pool {
    pub fn new(settings: Settings) -> Pool {
        Pool {
            settings,
            idle: Mutex::new(PoolState::default()),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection: an idle one, or a new one (reconnecting with backoff for up to
    /// `retry_for`, each failure logged), waiting while `max` are in use.
    pub fn get(&self) -> Result<Pooled<'_>> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            {
                let mut st = self.lock();
                while st.idle.is_empty() && st.open >= self.settings.max {
                    st = self
                        .freed
                        .wait_timeout(st, Duration::from_secs(1))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
                if let Some(conn) = st.idle.pop() {
                    return Ok(Pooled {
                        pool: self,
                        conn: Some(conn),
                    });
                }
                st.open += 1;
            }
            match self.settings.connect() {
                Ok(mut client) => {
                    let session = client
                        .query_opt(
                            "SELECT pid, backend_start::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                            &[],
                        )
                        .ok()
                        .flatten()
                        .map(|r| (r.get(0), r.get(1)));
                    let mut st = self.lock();
                    if std::mem::take(&mut st.down) {
                        tracing::warn!(server = %self.settings.display, "reconnected to PostgreSQL");
                    }
                    return Ok(Pooled {
                        pool: self,
                        conn: Some(Conn {
                            client,
                            prepared: HashMap::new(),
                            broken: false,
                            session,
                        }),
                    });
                }
                Err(e) => {
                    let mut st = self.lock();
                    st.open = st.open.saturating_sub(1);
                    st.down = true;
                    drop(st);
                    self.freed.notify_one();
                    let why = describe(&e);
                    if let Some(refused) = refused_at_connect(&e, &self.settings.display) {
                        return Err(Error::Refused(refused));
                    }
                    if started.elapsed() + delay > self.settings.retry_for {
                        return Err(Error::Unavailable(format!(
                            "cannot connect to PostgreSQL at {}: {why}",
                            self.settings.display
                        )));
                    }
                    tracing::warn!(server = %self.settings.display, error = %why, retry_in_ms = delay.as_millis() as u64, "cannot connect to PostgreSQL; retrying");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Waits before trying again after a lost connection; `false` once `retry_for` has passed
    /// since `started`.
    pub fn backoff(&self, started: Instant, attempt: u32) -> bool {
        let delay = Duration::from_millis(50u64 << attempt.min(5)).min(Duration::from_secs(2));
        if started.elapsed() + delay > self.settings.retry_for {
            return false;
        }
        std::thread::sleep(delay);
        true
    }
}
