//! A throwaway PostgreSQL cluster for tests: `initdb` in a temporary directory, a server on a
//! free loopback port, stopped and deleted when dropped. As root, the server runs as the
//! `postgres` user (it refuses to run as root).
//!
//! A missing PostgreSQL fails the test (`bash .ci/test` installs it) unless
//! `TETHER_ALLOW_SKIP=1` (never under `CI`) asks to skip it, which it says on stderr.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct PgCluster {
    bin: PathBuf,
    dir: PathBuf,
    /// Whether commits are flushed to disk (`fsync`): off for tests, on for the bench.
    durable: bool,
    pub port: u16,
    as_postgres: bool,
}

/// The directory of `initdb`, `pg_ctl` and `postgres`: `TETHER_PG_BIN`, the newest
/// `/usr/lib/postgresql/*/bin`, or the PATH.
fn bin_dir() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TETHER_PG_BIN") {
        return Some(PathBuf::from(p));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|b| b.join("initdb").exists())
        .collect();
    found.sort();
    if let Some(b) = found.pop() {
        return Some(b);
    }
    let out = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Path::new(&p)
        .parent()
        .map(Path::to_path_buf)
        .filter(|_| !p.is_empty())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl PgCluster {
    /// Starts a cluster, or `None` (said on stderr) where PostgreSQL is not installed and
    /// skips are allowed (`TETHER_ALLOW_SKIP=1`).
    pub fn start(name: &str) -> Option<PgCluster> {
        PgCluster::start_as(name, false)
    }

    /// A cluster that flushes every commit to disk, as a production server does (for
    /// `benches/postgres.rs`, which shares this file; no test needs it).
    #[allow(dead_code)]
    pub fn start_durable(name: &str) -> Option<PgCluster> {
        PgCluster::start_as(name, true)
    }

    fn start_as(name: &str, durable: bool) -> Option<PgCluster> {
        let Some(bin) = bin_dir() else {
            assert!(
                // As `common::skips_allowed` (this file is also a bench's, without `common`).
                std::env::var_os("CI").is_none()
                    && std::env::var("TETHER_ALLOW_SKIP").is_ok_and(|v| v == "1"),
                "PostgreSQL is not installed: bash .ci/test installs it (or set TETHER_PG_BIN), or set TETHER_ALLOW_SKIP=1 to skip the tests that need it"
            );
            eprintln!(
                "\n*** SKIPPED {name}: PostgreSQL is not installed (apt-get install postgresql, or set TETHER_PG_BIN) ***\n"
            );
            return None;
        };
        let as_postgres = is_root();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir =
            std::env::temp_dir().join(format!("tether-pg-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let c = PgCluster {
            bin,
            dir,
            durable,
            port: free_port(),
            as_postgres,
        };
        if as_postgres {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&c.dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown of the cluster directory to postgres");
        }
        let data = c.dir.join("data");
        c.run(
            "initdb",
            &[
                "-D",
                &data.to_string_lossy(),
                "-U",
                "tether",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        c.start_server();
        Some(c)
    }

    /// Starts the server (again, after [`PgCluster::stop_immediate`]).
    pub fn start_server(&self) {
        let data = self.dir.join("data");
        // TETHER_PG_OPTS: server settings added when investigating (`-c auto_explain...`).
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync={} -c max_connections=200 {}",
            self.port,
            self.dir.display(),
            if self.durable { "on" } else { "off" },
            std::env::var("TETHER_PG_OPTS").unwrap_or_default()
        );
        self.run(
            "pg_ctl",
            &[
                "-D",
                &data.to_string_lossy(),
                "-o",
                &opts,
                "-l",
                &self.dir.join("log").to_string_lossy(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`).
    pub fn stop_immediate(&self) {
        let data = self.dir.join("data");
        self.run(
            "pg_ctl",
            &[
                "-D",
                &data.to_string_lossy(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }

    /// The cluster's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Gives `path` (in the data directory) to the server's user, readable by it alone.
    pub fn own(&self, path: &Path) {
        if self.as_postgres {
            let ok = Command::new("chown")
                .arg("postgres:postgres")
                .arg(path)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown {}", path.display());
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }

    /// `postgres://tether@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://tether@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs `psql -c SQL` against the cluster; returns its output, unaligned, tuples only.
    pub fn psql(&self, sql: &str) -> String {
        let args = [
            "-X",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            &self.url(),
            "-c",
            sql,
        ];
        let out = Command::new(self.bin.join("psql"))
            .args(args)
            .output()
            .or_else(|_| Command::new("psql").args(args).output())
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The SQL text of `pg_dump` of one schema (a backup of it).
    pub fn dump_schema(&self, schema: &str) -> String {
        let out = Command::new(self.bin.join("pg_dump"))
            .args(["-d", &self.url(), "-n", schema, "--no-owner"])
            .output()
            .expect("pg_dump");
        assert!(
            out.status.success(),
            "pg_dump: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Replaces schema `schema` with a dump of it made by [`PgCluster::dump_schema`] (a restore).
    pub fn restore_schema(&self, schema: &str, dump: &str) {
        self.psql(&format!("DROP SCHEMA {schema} CASCADE"));
        let mut child = Command::new(self.bin.join("psql"))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", &self.url()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("psql");
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(dump.as_bytes())
            .expect("feed the dump");
        let out = child.wait_with_output().expect("psql");
        assert!(
            out.status.success(),
            "restore: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `tool` of the cluster's binaries, run as the `postgres` user when the tests are root.
    fn command(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        let mut c = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        c.current_dir(&self.dir);
        c
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let out = self.command(tool).args(args).output().expect(tool);
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
        );
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = self
            .command("pg_ctl")
            .args([
                "-D",
                &data.to_string_lossy(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One cluster for every test of a test binary, each test in a schema of its own. The
/// process does not drop statics, so a watchdog stops the server and deletes its directory
/// once the test process is gone (however it ended).
pub fn shared() -> Option<&'static PgCluster> {
    static SHARED: std::sync::OnceLock<Option<PgCluster>> = std::sync::OnceLock::new();
    SHARED
        .get_or_init(|| {
            let c = PgCluster::start("shared")?;
            let data = c.dir.join("data");
            let stop = format!(
                "{} {} -D {} -m immediate -w stop",
                if c.as_postgres { "runuser -u postgres --" } else { "" },
                c.bin.join("pg_ctl").display(),
                data.display()
            );
            let script = format!(
                "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf {dir}",
                pid = std::process::id(),
                dir = c.dir.display()
            );
            let _ = Command::new("setsid")
                .args(["sh", "-c", &script])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            Some(c)
        })
        .as_ref()
}

/// A fresh schema name for one test.
pub fn schema(name: &str) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(24)
        .collect();
    format!("t_{clean}_{n}")
}
