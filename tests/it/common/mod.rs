//! Helpers for tests that run the real `worker` binary in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub mod mcp;
pub mod pg;
pub mod proxy;
pub mod serve;
pub mod shop;
pub mod tls;
pub mod webdriver;

pub struct TempDir(pub PathBuf);

/// The backends a conformance test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Redb,
    Postgres,
}

/// The file in a test directory that names its database when it is not the default file.
const DB_FILE: &str = ".worker-db";

impl TempDir {
    /// A test directory whose `worker` runs use `backend`: the default redb file in it, or a
    /// schema of its own on the shared throwaway PostgreSQL cluster. `None` when PostgreSQL
    /// is not installed and skips are allowed (`TETHER_ALLOW_SKIP=1`; reported as skipped).
    pub fn on(name: &str, backend: Backend) -> Option<TempDir> {
        let dir = TempDir::new(name);
        if backend == Backend::Postgres {
            let pg = pg::shared()?;
            let url = format!("{}?schema={}", pg.url(), pg::schema(name));
            std::fs::write(dir.0.join(DB_FILE), url).expect("write the database URL");
        }
        Some(dir)
    }

    /// A test directory whose `worker` runs use the database `url`.
    pub fn with_db(name: &str, url: &str) -> TempDir {
        let dir = TempDir::new(name);
        std::fs::write(dir.0.join(DB_FILE), url).expect("write the database URL");
        dir
    }

    pub fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let p = std::env::temp_dir().join(format!("tether-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_worker")
}

/// The database URL of a test directory made by [`TempDir::on`] for PostgreSQL.
pub fn db_url(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(DB_FILE)).ok()
}

/// `worker` in `dir`, on its database: the default file there, or the directory's
/// PostgreSQL schema (through `WORKER_DB`).
pub fn command(dir: &Path) -> Command {
    let mut c = Command::new(bin());
    c.current_dir(dir)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_STORE")
        .env_remove("RUST_LOG");
    if let Some(url) = db_url(dir) {
        c.env("WORKER_DB", url);
    }
    c
}

/// A backup of a test directory's worker database: the file's bytes, or a dump of its
/// PostgreSQL schema. The demo store (its own file, or schema) is left out: it stands for a
/// tool service, which a restore of the worker's database does not roll back.
pub enum Backup {
    File(Vec<u8>),
    Schema(String, String),
}

impl Backup {
    pub fn take(dir: &Path) -> Backup {
        match db_url(dir) {
            None => Backup::File(std::fs::read(dir.join("worker.redb")).expect("read the file")),
            Some(url) => {
                let schema = url.rsplit("schema=").next().expect("a schema").to_string();
                let dump = pg::shared().expect("the cluster").dump_schema(&schema);
                Backup::Schema(schema, dump)
            }
        }
    }

    pub fn restore(&self, dir: &Path) {
        match self {
            Backup::File(bytes) => std::fs::write(dir.join("worker.redb"), bytes).expect("restore"),
            Backup::Schema(schema, dump) => pg::shared()
                .expect("the cluster")
                .restore_schema(schema, dump),
        }
    }
}

/// Runs `worker ARGS` in `dir` on its database.
pub fn worker(dir: &Path, args: &[&str]) -> Output {
    command(dir).args(args).output().expect("run worker")
}

pub fn ok(dir: &Path, args: &[&str]) -> String {
    succeeded(worker(dir, args), args)
}

/// The standard output of a `worker ARGS` run that must have succeeded (else its stderr).
pub fn succeeded(out: Output, args: &[&str]) -> String {
    assert!(
        out.status.success(),
        "worker {args:?} failed ({:?}):\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts `cmd` (a daemon; its output discarded), lets it run `ms` milliseconds, then
/// SIGKILLs and reaps it.
pub fn kill_after(cmd: &mut Command, ms: u64) {
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start daemon");
    std::thread::sleep(std::time::Duration::from_millis(ms));
    child.kill().expect("SIGKILL the daemon");
    child.wait().expect("reap the daemon");
}

pub fn json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let text = ok(dir, args);
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("worker {args:?} printed no JSON ({e}):\n{text}"))
}

/// Runs a failing command and returns (exit code, stderr).
pub fn fails(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = worker(dir, args);
    assert!(!out.status.success(), "worker {args:?} should have failed");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A program a test needs is missing: that fails the test (`bash .ci/test` installs it), unless
/// `TETHER_ALLOW_SKIP=1` asks for such tests to be skipped (never under CI); a skipped test
/// says so on stderr, so nothing reports `ok` without running unless it was asked to.
pub fn missing(what: &str, installed_by: &str) {
    assert!(
        skips_allowed(),
        "{what} is missing; {installed_by} (bash .ci/test installs it), or set TETHER_ALLOW_SKIP=1 to skip the tests that need it"
    );
    eprintln!("*** SKIPPED: {what} is missing (TETHER_ALLOW_SKIP is set) ***");
}

/// Whether a test may skip for a missing program: only when `TETHER_ALLOW_SKIP=1`, and never
/// under CI.
pub fn skips_allowed() -> bool {
    std::env::var_os("CI").is_none() && std::env::var("TETHER_ALLOW_SKIP").is_ok_and(|v| v == "1")
}

/// The seed of a randomized test: `TETHER_SEED` when given (to replay a run), else the clock.
/// Printed as `WHAT seed: TETHER_SEED=N`, so a failure can be replayed.
pub fn seed(what: &str) -> u64 {
    let seed = std::env::var("TETHER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        });
    println!("{what} seed: TETHER_SEED={seed}");
    seed
}

/// Sends signal `sig` (`-TERM`, `-STOP`, ...) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(st.success(), "kill {sig} {pid}");
}

/// The design reference's goal for Ana's damaged jacket.
pub const GOAL: &str = "refund the damaged item on order ord_1001";

/// `worker enqueue --user cu_ana --goal GOAL EXTRA...` (with `--model policy` unless EXTRA
/// names a model), which must succeed.
pub fn enqueue(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec!["enqueue", "--user", "cu_ana", "--goal", GOAL];
    if !extra.contains(&"--model") {
        args.extend_from_slice(&["--model", "policy"]);
    }
    args.extend_from_slice(extra);
    ok(dir, &args)
}

/// The digest of a task's held call, as `worker show --json` prints it.
pub fn held_digest(dir: &Path, task: &str) -> String {
    let v = json(dir, &["show", task, "--json"]);
    v["held"]["digest"]
        .as_str()
        .unwrap_or_else(|| panic!("task {task} holds no call: {v}"))
        .to_string()
}

/// The strict sink's invariant: a write of a non-idempotent tool (`issue_refund`) arrives at
/// the store at most once per call key, plus once more per `--not-applied` decision recorded
/// for that key in the audit log. Answers that refused it for approval do not count (the
/// approved re-send is the one send). Returns how many refund keys arrived.
pub fn assert_sent_at_most_once(dir: &Path, store_args: &[&str], seed: u64) -> usize {
    let mut args = vec!["store", "arrivals", "--json"];
    args.extend_from_slice(store_args);
    let arrivals = json(dir, &args);
    let events = json(dir, &["events", "--json"]);
    let mut sent: std::collections::BTreeMap<String, usize> = Default::default();
    for a in arrivals.as_array().expect("arrivals") {
        if a["tool"] == "issue_refund" && a["outcome"] != "needs_approval" {
            *sent
                .entry(a["key"].as_str().unwrap_or("").to_string())
                .or_default() += 1;
        }
    }
    for (key, n) in &sent {
        let resends = events
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["verb"] == "reconcile_not_applied" && e["detail"]["key"] == key.as_str())
            .count();
        assert!(
            *n <= 1 + resends,
            "refund key {key} arrived {n} times with {resends} --not-applied decision(s) (seed {seed})"
        );
    }
    sent.len()
}

/// splitmix64: a small seedable generator, the same on every machine, for seeded tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A draw in 0..n (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// `worker ARGS --json` as an array (empty if it printed none).
pub fn json_list(dir: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    json(dir, args).as_array().cloned().unwrap_or_default()
}

/// The demo shop's ledger, of the default store file.
pub fn ledger(dir: &Path) -> Vec<serde_json::Value> {
    json_list(dir, &["store", "ledger", "--json"])
}

/// The demo shop's arrivals log, of the default store file.
pub fn arrivals(dir: &Path) -> Vec<serde_json::Value> {
    json_list(dir, &["store", "arrivals", "--json"])
}

/// The refund amounts in a ledger, in order.
pub fn refund_amounts(ledger: &[serde_json::Value]) -> Vec<i64> {
    ledger
        .iter()
        .filter_map(|e| e["effect"]["amount_cents"].as_i64())
        .collect()
}

/// Scenario G on the default database: t1 suspended, its refund of 8000 waiting for approval.
pub fn suspended_g(dir: &Path) {
    enqueue(dir, &["--model", "policy:ord_1004:8000"]);
    ok(dir, &["run", "--drain"]);
    assert_eq!(json(dir, &["show", "t1", "--json"])["status"], "suspended");
}

/// Sends raw bytes to the server at `addr` (host:port) and reads its answer until it closes or
/// `wait` passes: (the status, 0 if none; the whole answer). With `half_close` the client shuts
/// its writing side first, as a client that sent everything does.
pub fn raw_http(
    addr: &str,
    bytes: &[u8],
    wait: std::time::Duration,
    half_close: bool,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(wait)).expect("timeout");
    let _ = s.write_all(bytes);
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// Every stored record of the worker database at `db` (the tables whose values are records),
/// with its table's name.
pub fn stored_records(db: &Path) -> Vec<(String, Vec<u8>)> {
    use redb::{ReadableDatabase, ReadableTable, TableHandle};
    let db = redb::Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
        .open(db)
        .expect("open");
    let r = db.begin_read().expect("read");
    let mut out = Vec::new();
    for t in r.list_tables().expect("tables") {
        let name = t.name().to_string();
        macro_rules! dump {
            ($k:ty) => {{
                let def: redb::TableDefinition<$k, &[u8]> = redb::TableDefinition::new(&name);
                let t = r.open_table(def).expect("table");
                for e in t.iter().expect("iter") {
                    let (_, v) = e.expect("entry");
                    out.push((name.clone(), v.value().to_vec()));
                }
            }};
        }
        match name.as_str() {
            "tasks" | "task_specs" | "blobs" | "call_keys" => dump!(&str),
            "spans" | "replies" => dump!((&str, u32)),
            "events" | "notes" => dump!(u64),
            _ => {}
        }
    }
    out
}

/// Defines each test twice, once per backend: `NAME::redb` and `NAME::postgres`, with the
/// same body run against a directory made by [`TempDir::on`].
#[macro_export]
macro_rules! conformance {
    ($(#[doc = $doc:literal])* fn $name:ident($d:ident) $body:block $($rest:tt)*) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body($d: &std::path::Path) $body
            #[test]
            fn redb() {
                let dir = $crate::common::TempDir::on(stringify!($name), $crate::common::Backend::Redb)
                    .expect("a directory");
                body(dir.path());
            }
            #[test]
            fn postgres() {
                let Some(dir) =
                    $crate::common::TempDir::on(stringify!($name), $crate::common::Backend::Postgres)
                else {
                    return;
                };
                body(dir.path());
            }
        }
        $crate::conformance! { $($rest)* }
    };
    () => {};
}

/// After daemons were killed: every enqueued task exists once, none is stuck running, and
/// each call key took effect at most once (exactly once for the tasks that ended done), with
/// no refund sent twice (arrivals log).
pub fn check_after_crashes(d: &Path, tasks_expected: usize, seed: u64) {
    use std::collections::BTreeMap;
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    let tasks = tasks.as_array().expect("list is an array");
    assert_eq!(
        tasks.len(),
        tasks_expected,
        "every enqueued task exists exactly once (seed {seed})"
    );
    let mut keys: Vec<&str> = tasks.iter().filter_map(|t| t["key"].as_str()).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), tasks_expected, "one task per key (seed {seed})");

    let ledger = json(d, &["store", "ledger", "--json"]);
    let ledger = ledger.as_array().expect("ledger is an array");
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    let mut per_task: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for e in ledger {
        let key = e["key"].as_str().expect("ledger key");
        *per_key.entry(key).or_default() += 1;
        let task = key.split(':').nth(1).unwrap_or("").to_string();
        let slot = per_task.entry(task).or_default();
        match e["effect"]["kind"].as_str() {
            Some("refund") => slot.0 += 1,
            Some("email") => slot.1 += 1,
            other => panic!("unexpected effect {other:?}"),
        }
    }
    for (key, n) in &per_key {
        assert_eq!(*n, 1, "call key {key} took effect {n} times (seed {seed})");
    }
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let id = t["id"].as_str().expect("id");
        let status = t["status"].as_str().expect("status");
        *by_status
            .entry(format!("{status}/{}", t["stop"].as_str().unwrap_or("-")))
            .or_default() += 1;
        assert!(
            matches!(status, "finished" | "suspended" | "held"),
            "task {id} ended {status} (seed {seed})"
        );
        let (refunds, emails) = per_task.get(id).copied().unwrap_or((0, 0));
        assert!(
            refunds <= 1 && emails <= 1,
            "task {id}: {refunds} refunds, {emails} emails (seed {seed})"
        );
        if t["stop"] == "done" {
            assert_eq!(
                (refunds, emails),
                (1, 1),
                "task {id} ended done (seed {seed})"
            );
        }
    }
    println!("after the crashes: {by_status:?}");
    let keys = assert_sent_at_most_once(d, &[], seed);
    assert!(keys > 0, "no refund reached the store (seed {seed})");
}

/// A test-side oracle settles every held write by asking the store's ledger and approves the
/// suspended tasks, in a few rounds; afterwards every task is finished and every effect of a
/// task that ended done appears exactly once, with no refund sent twice.
pub fn settle_with_oracle(d: &Path, seed: u64) {
    use std::collections::BTreeMap;
    // The oracle: a held write is applied exactly when the ledger has its call key; suspended
    // tasks are approved. A settled write can lead to an approval and back, so a few rounds.
    for _round in 0..3 {
        let ledger = json(d, &["store", "ledger", "--json"]);
        let ledger = ledger.as_array().expect("ledger");
        let held = json(d, &["reconcile", "--json"]);
        for h in held.as_array().expect("held list") {
            let (task, key) = (
                h["task"].as_str().expect("task"),
                h["key"].as_str().expect("key"),
            );
            let applied = ledger.iter().any(|e| e["key"] == key);
            let mut args = vec!["reconcile", task, "--key", key, "--by", "oracle"];
            args.extend_from_slice(&["--reason", "asked the ledger"]);
            if applied {
                args.push("--applied");
            } else {
                // A re-send needs budget left: grant it, as an operator would.
                args.extend_from_slice(&[
                    "--not-applied",
                    "--extend",
                    "tool_calls=1,deadline_ms=30000",
                ]);
            }
            ok(d, &args);
        }
        let suspended = json(
            d,
            &[
                "list",
                "--status",
                "suspended",
                "--json",
                "--limit",
                "10000",
            ],
        );
        for t in suspended.as_array().expect("suspended list") {
            let id = t["id"].as_str().expect("id");
            let digest = held_digest(d, id);
            ok(d, &["approve", id, "--by", "oracle", "--digest", &digest]);
        }
        ok(d, &["run", "--drain", "--max-in-flight", "4"]);
    }
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    let ledger = json(d, &["store", "ledger", "--json"]);
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_task: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for e in ledger.as_array().expect("ledger") {
        let key = e["key"].as_str().expect("key").to_string();
        let task = key.split(':').nth(1).unwrap_or("").to_string();
        *per_key.entry(key).or_default() += 1;
        let slot = per_task.entry(task).or_default();
        if e["effect"]["kind"] == "refund" {
            slot.0 += 1;
        } else {
            slot.1 += 1;
        }
    }
    assert!(
        per_key.values().all(|n| *n == 1),
        "an effect twice after reconcile (seed {seed}): {per_key:?}"
    );
    let mut settled: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks.as_array().expect("tasks") {
        let id = t["id"].as_str().expect("id");
        assert_eq!(
            t["status"], "finished",
            "task {id} is not final after reconcile (seed {seed}): {t}"
        );
        *settled
            .entry(t["stop"].as_str().unwrap_or("-").to_string())
            .or_default() += 1;
        if t["stop"] == "done" {
            assert_eq!(
                per_task.get(id).copied(),
                Some((1, 1)),
                "task {id} (seed {seed})"
            );
        }
    }
    assert_sent_at_most_once(d, &[], seed);
    println!("after reconcile and approvals: {settled:?}");
}

/// A request's `Idempotency-Key` header, if it has one (the services of the tests log it).
pub fn idempotency_key(req: &tiny_http::Request) -> Option<String> {
    req.headers()
        .iter()
        .find(|h| h.field.equiv("Idempotency-Key"))
        .map(|h| h.value.to_string())
}

/// The test directory's worker database, opened by this process: the PostgreSQL database its
/// daemons share, or its redb file.
pub fn database(d: &Path) -> Box<dyn tether::store::Backend> {
    match db_url(d) {
        Some(url) => Box::new(
            tether::store::pg::PgStore::open(&url, false, 1, std::time::Duration::from_secs(5))
                .expect("open"),
        ),
        None => {
            Box::new(tether::store::RedbStore::open(&d.join("worker.redb"), false).expect("open"))
        }
    }
}
