//! The PostgreSQL harness the backend's tests stand on (issue 10): a throwaway cluster of the
//! test's own starts on a free port, keeps a committed row across a crash-like stop
//! (`pg_ctl stop -m immediate`) and a restart, and is gone when the test ends.

use crate::common;
use common::pg::PgCluster;
use common::tls::{has_openssl, make_certs, openssl};
use common::*;
use postgres::fallible_iterator::FallibleIterator;
use std::time::{Duration, Instant};

#[test]
fn a_throwaway_cluster_keeps_committed_rows_across_an_immediate_stop() {
    let Some(pg) = PgCluster::start("harness") else {
        return;
    };
    pg.psql("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL)");
    pg.psql("INSERT INTO t VALUES (1, 'committed')");
    pg.stop_immediate();
    let refused = std::process::Command::new("psql")
        .args(["-X", "-d", &pg.url(), "-c", "SELECT 1"])
        .output()
        .map(|o| o.status.success());
    assert_ne!(
        refused.ok(),
        Some(true),
        "the server is down after the stop"
    );
    pg.start_server();
    assert_eq!(pg.psql("SELECT v FROM t WHERE id = 1"), "committed");
    assert_eq!(pg.psql("SHOW server_version_num").len(), 6);
}

/// Daemons starting together on a fresh database apply each migration once (advisory lock),
/// and a database migrated by a newer Tether is refused by every verb, with nothing changed.
#[test]
fn migrations_run_once_under_a_lock_and_a_newer_schema_is_refused() {
    let Some(pg) = PgCluster::start("migrations") else {
        return;
    };
    let dir = TempDir::with_db("migrations", &format!("{}?schema=mig", pg.url()));
    let d = dir.path();
    let racers: Vec<_> = (0..4)
        .map(|_| {
            command(d)
                .arg("migrate")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("migrate")
        })
        .collect();
    for r in racers {
        let out = r.wait_with_output().expect("migrate");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v = tether::store::pg::schema::SCHEMA_VERSION;
    assert_eq!(
        pg.psql("SELECT count(*) || ' ' || max(version) FROM mig.migrations"),
        format!("{v} {v}"),
        "each migration applied once"
    );
    let ids = pg.psql("SELECT count(*) FROM mig.meta WHERE key = 'db_id'");
    assert_eq!(ids, "1", "one database id");
    enqueue(d, &[]);
    pg.psql("INSERT INTO mig.migrations (version) VALUES (99)");
    for verb in [
        &["list"][..],
        &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"],
        &["run", "--drain"],
    ] {
        let (code, err) = fails(d, verb);
        assert_eq!(code, 1, "{verb:?}: {err}");
        assert!(
            err.contains("newer version of Tether") && err.contains("version 99"),
            "{verb:?}: {err}"
        );
    }
    assert_eq!(
        pg.psql("SELECT count(*) FROM mig.tasks"),
        "1",
        "nothing changed"
    );
}

/// An idle daemon is woken by NOTIFY: with its polling and recovery set ten minutes apart, a
/// task enqueued while it waits still runs (the test would wait those ten minutes without it).
#[test]
fn an_idle_daemon_is_woken_by_notify() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    use tether::store::pg::PgStore;
    use tether::tools::durable::DurableStore;
    let Some(pg) = PgCluster::start("notify") else {
        return;
    };
    let url = format!("{}?schema=wake", pg.url());
    let store = Arc::new(PgStore::open(&url, true, 4, Duration::from_secs(5)).expect("open"));
    let tools = Arc::new(DurableStore::open_target(&url).expect("store"));
    let stop = Arc::new(AtomicBool::new(false));
    let daemon = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let cfg = tether::worker::Config {
                demo: Some(std::sync::Arc::new(
                    tether::tools::durable::DemoShop::opened(std::sync::Arc::clone(&tools)),
                )),
                max_in_flight: 1,
                poll_ms: 600_000,
                recover_every_ms: 600_000,
                ..Default::default()
            };
            tether::worker::run(store, &cfg, stop).expect("daemon")
        })
    };
    // Let it find the queue empty and wait.
    std::thread::sleep(Duration::from_millis(500));
    let dir = TempDir::with_db("notify", &url);
    let id = enqueue(dir.path(), &[]).trim().to_string();
    let started = Instant::now();
    let mut status = String::new();
    while started.elapsed() < Duration::from_secs(120) {
        status = json(dir.path(), &["show", &id, "--json"])["status"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if status == "finished" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    // The stopping daemon waits for a wake-up too: send one.
    pg.psql("NOTIFY wake_ready");
    assert_eq!(status, "finished", "the idle daemon never started {id}");
    daemon.join().expect("daemon");
}

/// Review item 9: there was no TLS to PostgreSQL: `sslmode=require` could not connect
/// ("error performing TLS handshake"), `sslmode=prefer` sent everything in clear, and the
/// server's refusals printed as a bare "db error". Against a server that takes TLS
/// connections only: prefer and require connect encrypted, verify-ca and verify-full check the
/// certificate (verify-full its name too), a wrong root is refused, and a refusal quotes the
/// server.
#[test]
fn hole_9_tls_to_postgresql_with_libpqs_sslmodes() {
    if !has_openssl() {
        return;
    }
    let Some(pg) = PgCluster::start("tls") else {
        return;
    };
    let dir = TempDir::new("pg-tls");
    let d = dir.path();
    // A certificate authority, and the server's certificate for the name localhost.
    make_certs(d);
    let data = pg.data_dir();
    for f in ["server.crt", "server.key"] {
        std::fs::copy(d.join(f), data.join(f)).expect("copy");
        pg.own(&data.join(f));
    }
    // TLS connections only, from here on.
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n",
    )
    .expect("pg_hba.conf");
    pg.psql("ALTER SYSTEM SET ssl = on");
    pg.psql("SELECT pg_reload_conf()");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let url = |host: &str, params: &str| {
        format!(
            "postgres://tether@{host}:{}/postgres?schema=tls&{params}",
            pg.port
        )
    };
    let ca = d.join("ca.pem").display().to_string();
    let other = d.join("other.pem").display().to_string();
    for (host, params) in [
        ("127.0.0.1", String::new()),
        ("127.0.0.1", "sslmode=prefer".to_string()),
        ("127.0.0.1", "sslmode=require".to_string()),
        ("127.0.0.1", format!("sslmode=require&sslrootcert={ca}")),
        ("127.0.0.1", format!("sslmode=verify-ca&sslrootcert={ca}")),
        ("localhost", format!("sslmode=verify-full&sslrootcert={ca}")),
    ] {
        let db = url(host, &params);
        ok(d, &["--db", &db, "migrate"]);
        ok(
            d,
            &[
                "--db", &db, "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL,
            ],
        );
    }
    assert_eq!(
        pg.psql("SELECT count(*) FROM tls.tasks"),
        "6",
        "every one connected over TLS"
    );
    for (host, params, want) in [
        ("127.0.0.1", "sslmode=disable".to_string(), "no encryption"),
        (
            "127.0.0.1",
            format!("sslmode=verify-full&sslrootcert={ca}"),
            "certificate",
        ),
        (
            "localhost",
            format!("sslmode=verify-ca&sslrootcert={other}"),
            "certificate",
        ),
        (
            "127.0.0.1",
            "sslmode=verify-full".to_string(),
            "sslrootcert",
        ),
        ("127.0.0.1", "sslmode=sometimes".to_string(), "sslmode"),
    ] {
        let db = url(host, &params);
        let (code, err) = fails(d, &["--db", &db, "list"]);
        assert!(code == 1 || code == 2, "{params}: {code} {err}");
        assert!(err.contains(want), "{params}: {err}");
        assert!(!err.contains("db error\n"), "{params}: {err}");
    }
    // A self-signed server certificate, given as its own root, is trusted as it is (libpq's
    // way), its name still checked by verify-full.
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            "self.key",
            "-out",
            "self.pem",
        ],
    );
    std::fs::copy(d.join("self.pem"), data.join("server.crt")).expect("copy");
    std::fs::copy(d.join("self.key"), data.join("server.key")).expect("copy");
    pg.own(&data.join("server.crt"));
    pg.own(&data.join("server.key"));
    pg.psql("SELECT pg_reload_conf()");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let own = d.join("self.pem").display().to_string();
    ok(
        d,
        &[
            "--db",
            &url(
                "localhost",
                &format!("sslmode=verify-full&sslrootcert={own}"),
            ),
            "list",
        ],
    );
    ok(
        d,
        &[
            "--db",
            &url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={own}")),
            "list",
        ],
    );
    let (_, err) = fails(
        d,
        &[
            "--db",
            &url(
                "127.0.0.1",
                &format!("sslmode=verify-full&sslrootcert={own}"),
            ),
            "list",
        ],
    );
    assert!(
        err.contains("certificate of the PostgreSQL server"),
        "{err}"
    );
    let (_, err) = fails(
        d,
        &[
            "--db",
            &url("localhost", &format!("sslmode=verify-ca&sslrootcert={ca}")),
            "list",
        ],
    );
    assert!(
        err.contains("certificate of the PostgreSQL server") && !err.contains("PostgreSQL error"),
        "{err}"
    );
    // A role that does not exist: the server's own message, at once.
    let nobody = format!(
        "postgres://nobody@127.0.0.1:{}/postgres?schema=tls",
        pg.port
    );
    let (code, err) = fails(d, &["--db", &nobody, "list"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("role \"nobody\" does not exist"), "{err}");
    assert!(err.contains("refused the connection"), "{err}");
}

/// A settle notifies the settled channel only while a session is registered to listen
/// (migration 8): `NOTIFY` serializes commits, so with no waiter none is sent; a row left by a
/// session that is gone does not count, and the next registration removes it.
#[test]
fn settles_notify_only_while_a_waiter_is_registered() {
    let Some(pg) = common::pg::shared() else {
        return;
    };
    let s = common::pg::schema("notify");
    let dir = TempDir::with_db("notify", &format!("{}?schema={s}", pg.url()));
    let d = dir.path();
    ok(d, &["migrate"]);
    let mut listener = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    listener
        .batch_execute(&format!("LISTEN {s}_settled"))
        .expect("LISTEN");
    let settle_one = |listener: &mut postgres::Client| -> Vec<String> {
        let id = enqueue(d, &[]).trim().to_string();
        ok(d, &["run", "--drain"]);
        // Notifications of transactions committed before this round trip have arrived.
        listener.simple_query("SELECT 1").expect("round trip");
        let got: Vec<String> = listener
            .notifications()
            .iter()
            .map(|n| Ok(n.payload().to_string()))
            .collect()
            .expect("read the notifications");
        assert!(got.iter().all(|p| *p == id), "{got:?} for {id}");
        got
    };
    assert_eq!(
        settle_one(&mut listener),
        Vec::<String>::new(),
        "no one waits"
    );
    pg.psql(&format!(
        "INSERT INTO {s}.waiters (pid) VALUES (2147483000)"
    ));
    assert_eq!(
        settle_one(&mut listener),
        Vec::<String>::new(),
        "a registration whose session is gone"
    );
    let register =
        tether::store::pg::schema::sql(tether::store::pg::schema::REGISTER_WAITER, &s, "");
    listener.batch_execute(&register).expect("register");
    assert!(
        !settle_one(&mut listener).is_empty(),
        "a registered waiter is notified"
    );
    assert_eq!(
        pg.psql(&format!("SELECT count(*) FROM {s}.waiters")),
        "1",
        "the registration removed the row of the session that is gone"
    );
}

/// A registration never completes while a settling transaction that already looked for
/// waiters and found none is open: it waits for it (at most 100 ms, so settles do not queue
/// behind it) and is tried again; once the settle committed, it goes through. So whatever the
/// new waiter reads next includes the settle, and no wake-up falls between the two.
#[test]
fn a_registration_waits_for_a_settle_that_found_no_waiter() {
    let Some(pg) = common::pg::shared() else {
        return;
    };
    let s = common::pg::schema("register");
    let dir = TempDir::with_db("register", &format!("{}?schema={s}", pg.url()));
    let d = dir.path();
    ok(d, &["migrate"]);
    let id = enqueue(d, &[]).trim().to_string();
    let mut settler = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let mut tx = settler.transaction().expect("begin");
    let n = tx
        .execute(
            &format!("UPDATE {s}.tasks SET status = 'finished' WHERE id = $1"),
            &[&id],
        )
        .expect("settle");
    assert_eq!(n, 1);
    let register =
        tether::store::pg::schema::sql(tether::store::pg::schema::REGISTER_WAITER, &s, "");
    let try_register = || {
        let mut c = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
        c.batch_execute(&format!("LISTEN {s}_settled"))
            .expect("LISTEN");
        c.batch_execute(&register).map(|()| c)
    };
    for _ in 0..3 {
        let e = try_register()
            .err()
            .expect("no registration while the settle is open");
        assert_eq!(
            e.code(),
            Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE),
            "{e:?}"
        );
    }
    tx.commit().expect("commit the settle");
    let _registered =
        try_register().expect("the registration goes through once the settle committed");
    assert_eq!(pg.psql(&format!("SELECT count(*) FROM {s}.waiters")), "1");
}

/// Two claimers on one key, the second reaching the key's slot row while the first holds it:
/// the second's claim is cut to what the limit has left once the first commits, not to what
/// its own snapshot counted (which would run one task too many). The first claimer is a
/// transaction held open here, taking a slot as a claim's upsert does.
#[test]
fn a_claim_that_waits_on_a_keys_slot_takes_only_what_is_left() {
    use tether::store::Queue;
    use tether::store::flow::ConcurrencyLimits;
    let Some(pg) = common::pg::shared() else {
        return;
    };
    let s = common::pg::schema("slot_race");
    let url = format!("{}?schema={s}", pg.url());
    let store =
        tether::store::pg::PgStore::open(&url, true, 4, Duration::from_secs(5)).expect("open");
    store.set_limits(ConcurrencyLimits::new([("tenant:*".to_string(), 3)]).expect("limits"));
    let now = tether::clock::now_ms();
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let mut t = crate::exactly_once::new_task("cu_ana", "work", None);
            t.concurrency_key = Some("tenant:acme".into());
            t
        })
        .collect();
    store.enqueue(&tasks, now).expect("enqueue");
    let lease = tether::store::Lease {
        owner: "a".into(),
        host: "test-host".into(),
        pid: 1,
        start_ticks: 0,
        expires_at_ms: now + 60_000,
        token: 0,
    };
    assert_eq!(store.claim(&lease, 1, now).expect("claim").len(), 1);
    // The other claimer: it took a second slot and has not committed yet.
    let mut other = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let mut tx = other.transaction().expect("begin");
    tx.execute(
        &format!("UPDATE {s}.slots SET running = running + 1 WHERE key = 'tenant:acme'"),
        &[],
    )
    .expect("take a slot");
    let claimer = std::thread::spawn(move || store.claim(&lease, 100, now).expect("claim"));
    // Wait until the claim waits on the slot row's lock.
    let mut watch = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = watch
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%slots%'",
                &[],
            )
            .expect("activity")
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the claim never waited on the slot row"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    tx.commit().expect("commit");
    let got = claimer.join().expect("claimer");
    assert_eq!(
        got.len(),
        1,
        "the limit is 3 and 2 were taken: the claim may take 1, it took {}",
        got.len()
    );
    let running: i32 = watch
        .query_one(
            &format!("SELECT running FROM {s}.slots WHERE key = 'tenant:acme'"),
            &[],
        )
        .expect("slots")
        .get(0);
    assert_eq!(running, 3);
}

/// A claim that waits on a key's slot row past the `lock_timeout` (another claimer holds it)
/// takes nothing and fails nothing: the daemon's next claim takes the tasks once the row is
/// free (before, the error ended the daemon).
#[test]
fn a_claim_that_gives_way_on_a_slot_row_takes_nothing_and_keeps_going() {
    use tether::store::Queue;
    use tether::store::flow::ConcurrencyLimits;
    let Some(pg) = common::pg::shared() else {
        return;
    };
    let s = common::pg::schema("slot_timeout");
    let url = format!("{}?schema={s}", pg.url());
    let store =
        tether::store::pg::PgStore::open(&url, true, 4, Duration::from_secs(5)).expect("open");
    store.set_limits(ConcurrencyLimits::new([("tenant:*".to_string(), 3)]).expect("limits"));
    let now = tether::clock::now_ms();
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let mut t = crate::exactly_once::new_task("cu_ana", "work", None);
            t.concurrency_key = Some("tenant:acme".into());
            t
        })
        .collect();
    store.enqueue(&tasks, now).expect("enqueue");
    let lease = tether::store::Lease {
        owner: "a".into(),
        host: "test-host".into(),
        pid: 1,
        start_ticks: 0,
        expires_at_ms: now + 60_000,
        token: 0,
    };
    assert_eq!(store.claim(&lease, 1, now).expect("claim").len(), 1);
    // Another claimer holds the key's slot row past the claim's lock_timeout (10 s).
    let mut other = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let mut tx = other.transaction().expect("begin");
    tx.execute(
        &format!("SELECT running FROM {s}.slots WHERE key = 'tenant:acme' FOR UPDATE"),
        &[],
    )
    .expect("lock the slot row");
    let got = store
        .claim(&lease, 8, now)
        .expect("a claim that gave way is not an error");
    assert!(
        got.is_empty(),
        "it took {} while the row was locked",
        got.len()
    );
    tx.rollback().expect("release");
    let got = store.claim(&lease, 8, now).expect("claim");
    assert_eq!(
        got.len(),
        2,
        "the limit's room (3, 1 taken) is taken once the row is free"
    );
}

/// The pages one claim's plan touches, from `EXPLAIN (ANALYZE, BUFFERS)` of `sql` run with
/// each set of `runs` in one transaction (rolled back), measured on the last run (the first
/// ones warm the session: its catalog, the function's compiled plan); and what `claimed`
/// (a count) reads in that transaction before the rollback.
fn claim_pages(
    pg: &PgCluster,
    sql: &str,
    runs: &[&[&(dyn postgres::types::ToSql + Sync)]],
    claimed: &str,
) -> (u64, i64, serde_json::Value) {
    let mut c = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let mut tx = c.transaction().expect("begin");
    let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
    let mut last = None;
    for params in runs {
        last = Some(tx.query_one(&explain, params).expect("explain the claim"));
    }
    let n: i64 = tx
        .query_one(claimed, &[])
        .expect("count the claimed")
        .get(0);
    tx.rollback().expect("rollback");
    let plan: postgres::types::Json<serde_json::Value> = last.expect("a run").get(0);
    let top = &plan.0[0]["Plan"];
    let pages = top["Shared Hit Blocks"].as_u64().unwrap_or(0)
        + top["Shared Read Blocks"].as_u64().unwrap_or(0);
    (pages, n, plan.0)
}

/// A claim reads the head of the ready queue, not all of it, on a table the planner has no
/// statistics for yet (a new schema, a queue that grew since the last `ANALYZE`). With 3,000
/// tasks enqueued and 1,000 of them claimed (their entries in the ready index are dead until
/// a vacuum), a claim, and a final commit that claims the thread's next task, touch a few
/// dozen pages each (the final commit 52 here, its claim 10 of them). A plan that read every
/// queued row and sorted them (a bitmap scan, which the planner chose for the final commit's
/// claim) read 556 on every such commit: 64 threads' claims slowed down as the backlog grew.
#[test]
fn a_claim_reads_the_head_of_the_queue_not_all_of_it() {
    use tether::store::Queue;
    // A cluster of its own: another test's open transaction on a shared one would keep the
    // claimed rows' old versions visible to someone, and every scan would visit them.
    let Some(cluster) = PgCluster::start("claim_plan") else {
        return;
    };
    let pg = &cluster;
    let s = common::pg::schema("claim_plan");
    let url = format!("{}?schema={s}", pg.url());
    let store =
        tether::store::pg::PgStore::open(&url, true, 4, Duration::from_secs(5)).expect("open");
    // No statistics, as on a new schema: autovacuum would analyze the table after the
    // inserts below, and the planner, knowing how many rows are queued, might then pick the
    // ordered scan by itself and hide a plan that is not pinned.
    let mut admin = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    admin
        .batch_execute(&format!(
            "ALTER TABLE {s}.tasks SET (autovacuum_enabled = off)"
        ))
        .expect("autovacuum off");
    let now = tether::clock::now_ms();
    let tasks: Vec<_> = (0..3000)
        .map(|_| crate::exactly_once::new_task("cu_ana", "work", None))
        .collect();
    store.enqueue(&tasks, now).expect("enqueue");
    let lease = tether::store::Lease {
        owner: "a".into(),
        host: "test-host".into(),
        pid: 1,
        start_ticks: 0,
        expires_at_ms: now + 600_000,
        token: 0,
    };
    let mut claimed = Vec::new();
    for _ in 0..10 {
        claimed.extend(store.claim(&lease, 100, now).expect("claim"));
    }
    assert_eq!(claimed.len(), 1000);
    let lease_json = postgres::types::Json(serde_json::json!({"owner": "b"}));
    let claim: &[&(dyn postgres::types::ToSql + Sync)] =
        &[&1i64, &lease_json, &"b", &60_000i64, &0i64, &7i64];
    let (pages, took, plan) = claim_pages(
        pg,
        &store.claim_statement(),
        &[claim, claim],
        &format!("SELECT count(*) FROM {s}.tasks WHERE claim_commit = 7 AND status = 'running'"),
    );
    assert_eq!(took, 2, "each claim took one task: {plan}");
    assert!(pages < 100, "a claim read {pages} pages: {plan:#}");

    // Final commits of claimed tasks, each claiming the next task in the same statement.
    let none_text: Option<String> = None;
    let none_int: Option<i32> = None;
    let none_big: Option<i64> = None;
    let none_json: Option<postgres::types::Json<serde_json::Value>> = None;
    let spans = postgres::types::Json(serde_json::json!([]));
    let state = postgres::types::Json(serde_json::json!({}));
    let tokens: Vec<i64> = claimed
        .iter()
        .map(|t| t.lease.as_ref().map_or(0, |l| l.token) as i64)
        .collect();
    let markers = [8i64, 9];
    let params = |i: usize| -> Vec<&(dyn postgres::types::ToSql + Sync)> {
        vec![
            &claimed[i].id,
            &tokens[i],
            &markers[i],
            &0i64,
            &none_text,
            &none_int,
            &none_text,
            &none_json,
            &none_text,
            &none_big,
            &none_json,
            &none_big,
            &none_int,
            &none_json,
            &spans,
            &state,
            &0i32,
            &false,
            &0i64,
            &"finished",
            &false,
            &false,
            &none_text,
            &none_text,
            &none_text,
            &lease_json,
            &"b",
            &60_000i64,
        ]
    };
    let (first, second) = (params(0), params(1));
    let (pages, took, plan) = claim_pages(
        pg,
        &store.final_claim_statement(),
        &[first.as_slice(), second.as_slice()],
        &format!(
            "SELECT count(*) FROM {s}.tasks WHERE claim_commit IN (8, 9) AND status = 'running'"
        ),
    );
    assert_eq!(
        took, 2,
        "each final commit was accepted and claimed the next task: {plan}"
    );
    let claimed_next = &plan[0]["Plan"];
    assert!(
        pages < 100,
        "a final commit and the claim in it read {pages} pages: {claimed_next:#}"
    );
}
