//! Several hosts on one PostgreSQL, and the database itself failing (issue 10).
//!
//! - Three daemons with distinct identities share one queue; they are killed with SIGKILL at
//!   36 random moments and restarted, and one of them, which reaches the database through a
//!   TCP proxy the test controls, is cut off while it holds leases and then reconnected: its
//!   claims are taken over when its heartbeat runs out, and whatever it commits afterwards is
//!   refused by the fencing token.
//! - Two daemons run while PostgreSQL is stopped with `pg_ctl stop -m immediate` and started
//!   again three times, and while the proxy loses answers (the connection drops after a
//!   request reached the server, so a COMMIT may land without its acknowledgment): every
//!   acknowledged enqueue and approval exists afterwards.
//!
//! In both, no refund arrives at the store twice (arrivals log), nothing is lost, duplicated
//! or stuck, and after an oracle settles the held writes every task has ended. The seed is
//! printed; `TETHER_SEED=<seed>` replays the task mix and schedule.

use crate::common;
use common::pg::PgCluster;
use common::proxy::Proxy;
use common::*;

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A batch file of `n` tasks: mostly the design reference's Policy (refund and email), some that
/// suspend for approval, some that get stuck; each with its own store tenant and key.
fn task_file(d: &Path, rng: &mut Rng, prefix: &str, n: usize) -> String {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let model = match rng.below(10) {
                0 => "policy:ord_1004:8000",
                1 => "new_ids",
                2 => "same_call",
                _ => "policy",
            };
            format!(
                r#"{{"user": "cu_ana", "goal": "{GOAL}", "key": "{prefix}-{i}", "model": "{model}", "store_scope": "{prefix}{i}"}}"#
            )
        })
        .collect();
    let f = format!("{prefix}.jsonl");
    std::fs::write(d.join(&f), lines.join("\n")).expect("write tasks");
    f
}

/// A daemon on `url`, logging warnings to `log`.
fn daemon(d: &Path, url: &str, log: &Path, extra: &[&str]) -> Child {
    let log = std::fs::File::create(log).expect("daemon log");
    command(d)
        .env("WORKER_DB", url)
        .env("RUST_LOG", "warn,tether::store::pg=info")
        .args(["run", "--max-in-flight", "3", "--time-scale", "0.02"])
        .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start a daemon")
}

fn stop(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// How many lines of the logs in `d` whose name starts with `prefix` contain `text`.
fn count_in_logs(d: &Path, prefix: &str, text: &str) -> usize {
    std::fs::read_dir(d)
        .expect("test dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(text))
                .count()
        })
        .sum()
}

/// A throwaway cluster, a proxy in front of it, the URLs of schema `name` directly and through
/// the proxy, and a test directory on the direct one, with the demo shop created.
fn setup(name: &str) -> Option<(PgCluster, Proxy, String, TempDir)> {
    let pg = PgCluster::start(name)?;
    let proxy = Proxy::start(pg.port);
    let direct = format!("{}?schema={name}", pg.url());
    let via = format!(
        "postgres://tether@127.0.0.1:{}/postgres?schema={name}",
        proxy.port
    );
    let dir = TempDir::with_db(name, &direct);
    ok(dir.path(), &["store", "orders"]);
    Some((pg, proxy, via, dir))
}

#[test]
fn three_daemons_killed_and_one_cut_off_lose_and_repeat_nothing() {
    const TASKS: usize = 90;
    const KILLS: usize = 36;
    let seed = seed("several hosts");
    let mut rng = Rng(seed);
    let Some((pg, proxy, cut_off, dir)) = setup("hosts") else {
        return;
    };
    let d = dir.path();
    let direct = db_url(d).expect("the direct URL");
    let f = task_file(d, &mut rng, "h", TASKS);
    ok(d, &["enqueue", "--model", "policy", "--file", &f]);

    // Hosts 0 and 1 reach the database directly, host 2 through the proxy.
    let urls = [direct.clone(), direct.clone(), cut_off];
    let mut runs = [0usize; 3];
    let start = |slot: usize, runs: &mut [usize; 3]| {
        runs[slot] += 1;
        let log = d.join(format!("host{slot}-{}.log", runs[slot]));
        daemon(d, &urls[slot], &log, &[])
    };
    let mut hosts: Vec<Child> = (0..3).map(|s| start(s, &mut runs)).collect();
    let (mut cuts, mut taken_over) = (0, 0);
    for k in 0..KILLS {
        std::thread::sleep(Duration::from_millis(60 + rng.below(200)));
        if k == KILLS / 3 {
            // Wait until host 2 holds leases, then cut it off past its heartbeat.
            let pid = hosts[2].id();
            let held = |pg: &PgCluster| {
                pg.psql(&format!(
                    "SELECT string_agg(id || '=' || token, ',' ORDER BY id) FROM hosts.tasks \
                     WHERE status = 'running' AND lease_owner LIKE '%:{pid}:%'"
                ))
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut claims = held(&pg);
            while claims.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                claims = held(&pg);
            }
            proxy.cut();
            cuts += 1;
            // Past its heartbeat (3 s) and a recovery round of the others.
            std::thread::sleep(Duration::from_millis(4_500));
            // Its claims were taken over: each task moved on to a newer token (or ended).
            for claim in claims.split(',').filter(|c| !c.is_empty()) {
                let (id, token) = claim.split_once('=').expect("id=token");
                let now = pg.psql(&format!(
                    "SELECT status || ' ' || token FROM hosts.tasks WHERE id = '{id}'"
                ));
                let (status, now_token) = now.split_once(' ').expect("status token");
                assert!(
                    now_token != token || status != "running",
                    "task {id} is still under the cut-off host's claim {token}: {now} (seed {seed})"
                );
                taken_over += 1;
            }
            proxy.restore();
            // Let the reconnected host try to commit under its superseded claims.
            std::thread::sleep(Duration::from_millis(1_000));
        }
        let slot = rng.below(3) as usize;
        stop(&mut hosts[slot]);
        hosts[slot] = start(slot, &mut runs);
    }
    for h in &mut hosts {
        stop(h);
    }
    ok(
        d,
        &[
            "run",
            "--drain",
            "--max-in-flight",
            "4",
            "--recover-every-ms",
            "200",
        ],
    );
    check_after_crashes(d, TASKS, seed);
    let refused = count_in_logs(d, "host2-", "claim superseded");
    println!(
        "{KILLS} kills, {cuts} cut with {taken_over} claims taken over, {refused} stale commits of the cut-off host refused"
    );
    assert!(
        taken_over > 0,
        "the cut-off host held no claim (seed {seed})"
    );
    settle_with_oracle(d, seed);
}

#[test]
fn the_database_restarting_and_lost_answers_lose_and_repeat_nothing() {
    const RESTARTS: usize = 3;
    let seed = seed("database failure");
    let mut rng = Rng(seed);
    // The daemons' proxy loses answers; the job and the operator connect directly.
    let Some((pg, proxy, via, dir)) = setup("restarts") else {
        return;
    };
    let d = dir.path().to_path_buf();
    let direct = db_url(&d).expect("the direct URL");
    let mut hosts: Vec<Child> = (0..2)
        .map(|s| daemon(&d, &via, &d.join(format!("db{s}.log")), &[]))
        .collect();

    // A job enqueues tasks one by one through the proxy, retrying each until it is
    // acknowledged; an operator approves what is suspended. Both record what was acknowledged.
    let done = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let approved: Arc<Mutex<Vec<String>>> = Arc::default();
    let models = ["policy", "policy", "policy:ord_1004:8000", "same_call"];
    let job = {
        let (d, via, done, acked) = (d.clone(), direct.clone(), done.clone(), acked.clone());
        let picks: Vec<usize> = (0..400).map(|_| rng.below(4) as usize).collect();
        std::thread::spawn(move || {
            for (i, m) in picks.into_iter().enumerate() {
                if done.load(Ordering::SeqCst) {
                    break;
                }
                let key = format!("r-{i}");
                loop {
                    let out = command(&d)
                        .env("WORKER_DB", &via)
                        .args(["enqueue", "--user", "cu_ana", "--goal", GOAL, "--key", &key])
                        .args(["--model", models[m], "--store-scope", &key])
                        .output()
                        .expect("enqueue");
                    if out.status.success() {
                        acked.lock().expect("acked").push(key.clone());
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        })
    };
    let operator = {
        let (d, via, done, approved) = (d.clone(), direct.clone(), done.clone(), approved.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(150));
                let out = command(&d)
                    .env("WORKER_DB", &via)
                    .args([
                        "list",
                        "--status",
                        "suspended",
                        "--json",
                        "--limit",
                        "10000",
                    ])
                    .output()
                    .expect("list");
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
                    continue;
                };
                for t in v.as_array().into_iter().flatten() {
                    let id = t["id"].as_str().unwrap_or("").to_string();
                    let shown = command(&d)
                        .env("WORKER_DB", &via)
                        .args(["show", &id, "--json"])
                        .output()
                        .expect("show");
                    let Ok(s) = serde_json::from_slice::<serde_json::Value>(&shown.stdout) else {
                        continue;
                    };
                    let Some(digest) = s["held"]["digest"].as_str() else {
                        continue;
                    };
                    let out = command(&d)
                        .env("WORKER_DB", &via)
                        .args(["approve", &id, "--by", "op", "--digest", digest])
                        .output()
                        .expect("approve");
                    if out.status.success() {
                        approved.lock().expect("approved").push(id);
                    }
                }
            }
        })
    };

    let mut lost_asked = 0;
    for _ in 0..RESTARTS {
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(150 + rng.below(200)));
            proxy.lose_answers(1);
            lost_asked += 1;
        }
        pg.stop_immediate();
        std::thread::sleep(Duration::from_millis(300 + rng.below(700)));
        pg.start_server();
    }
    // Answers lost until one hits a daemon's commit that landed (most of them do; a few
    // hit reads, the LISTEN session, or a commit the restart rolled back).
    let deadline = Instant::now() + Duration::from_secs(30);
    while count_in_logs(&d, "db", "the commit had landed") == 0 && Instant::now() < deadline {
        proxy.lose_answers(1);
        lost_asked += 1;
        std::thread::sleep(Duration::from_millis(150));
    }
    std::thread::sleep(Duration::from_millis(500));
    done.store(true, Ordering::SeqCst);
    job.join().expect("the enqueue job");
    operator.join().expect("the operator");
    for h in &mut hosts {
        stop(h);
    }
    ok(
        &d,
        &[
            "run",
            "--drain",
            "--max-in-flight",
            "4",
            "--recover-every-ms",
            "200",
        ],
    );
    let acked = acked.lock().expect("acked").clone();
    let tasks = json(&d, &["list", "--json", "--limit", "10000"]);
    let keys: std::collections::BTreeSet<&str> = tasks
        .as_array()
        .expect("tasks")
        .iter()
        .filter_map(|t| t["key"].as_str())
        .collect();
    for k in &acked {
        assert!(
            keys.contains(k.as_str()),
            "acknowledged enqueue {k} is missing (seed {seed})"
        );
    }
    let events = json(&d, &["events", "--json"]);
    for id in approved.lock().expect("approved").iter() {
        assert!(
            events
                .as_array()
                .expect("events")
                .iter()
                .any(|e| e["verb"] == "approve" && e["task"] == id.as_str()),
            "acknowledged approval of {id} is missing (seed {seed})"
        );
    }
    check_after_crashes(&d, acked.len(), seed);
    if std::env::var("TETHER_VERBOSE").is_ok() {
        for e in std::fs::read_dir(&d).expect("dir").flatten() {
            if e.file_name().to_string_lossy().starts_with("db") {
                for l in std::fs::read_to_string(e.path())
                    .unwrap_or_default()
                    .lines()
                {
                    if l.contains("landed") || l.contains("lost") {
                        println!("{l}");
                    }
                }
            }
        }
    }
    let read_back = count_in_logs(&d, "db", "reading back whether it landed");
    let landed = count_in_logs(&d, "db", "had landed");
    let reconnected = count_in_logs(&d, "db", "reconnected to PostgreSQL");
    println!(
        "{RESTARTS} restarts, {} of {lost_asked} answers lost, {} tasks acknowledged, {} approvals; daemons: {read_back} commits read back ({landed} had landed), {reconnected} reconnections",
        proxy.lost(),
        acked.len(),
        approved.lock().expect("approved").len()
    );
    assert!(
        reconnected > 0,
        "the daemons never reconnected (seed {seed})"
    );
    assert!(
        landed > 0,
        "no lost answer hit a daemon's commit that landed (seed {seed}): the read-back was not exercised"
    );
    settle_with_oracle(&d, seed);
}

/// How many server processes are waiting on `what` (`wait_event` or `wait_event_type`).
fn waiting_on(pg: &PgCluster, what: &str) -> usize {
    pg.psql(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE (wait_event = '{what}' OR wait_event_type = '{what}') AND pid <> pg_backend_pid()"
    ))
    .parse()
    .unwrap_or(0)
}

/// Review item 4: one enqueue made two tasks on PostgreSQL with a synchronous standby. A
/// COMMIT waiting for the standby is durable on the primary but not yet visible; when its
/// acknowledgment was lost, the marker read back as "not landed", the transaction ran again,
/// and when the standby answered both landed. The read-back now waits for a transaction that
/// is still in progress and settles exactly whether it landed: one task.
#[test]
fn hole_4_an_enqueue_waiting_for_a_standby_lands_once() {
    let Some(pg) = PgCluster::start("sync-standby") else {
        return;
    };
    let dir = TempDir::new("pg-sync-standby");
    let d = dir.path();
    let proxy = Proxy::start(pg.port);
    let via_proxy = format!(
        "postgres://tether@127.0.0.1:{}/postgres?schema=sync",
        proxy.port
    );
    let direct = format!("{}?schema=sync", pg.url());
    ok(d, &["--db", &direct, "migrate"]);
    // From now on every commit waits for a standby that is not there.
    pg.psql("ALTER SYSTEM SET synchronous_standby_names = 'absent_standby'");
    pg.psql("SELECT pg_reload_conf()");
    let enqueue = command(d)
        .args([
            "--db", &via_proxy, "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("enqueue");
    let deadline = Instant::now() + Duration::from_secs(60);
    while waiting_on(&pg, "SyncRep") == 0 {
        assert!(
            Instant::now() < deadline,
            "the COMMIT never waited for the standby"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The COMMIT's acknowledgment is lost: the connection drops while it waits.
    proxy.cut();
    proxy.restore();
    // The client reads back whether it landed: it waits for the transaction in progress
    // (a lock wait), where the code before ran the transaction again (a second COMMIT
    // waiting for the standby).
    while waiting_on(&pg, "SyncRep") + waiting_on(&pg, "Lock") < 2 {
        assert!(Instant::now() < deadline, "the client never came back");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The standby "answers": every waiting COMMIT lands.
    pg.psql("ALTER SYSTEM SET synchronous_standby_names = ''");
    pg.psql("SELECT pg_reload_conf()");
    let out = enqueue.wait_with_output().expect("enqueue");
    let printed = succeeded(out, &["enqueue", "--model", "policy"]);
    assert_eq!(printed.trim(), "t1", "{printed}");
    let tasks = pg.psql("SELECT string_agg(id, ',' ORDER BY id) FROM sync.tasks");
    assert_eq!(tasks, "t1", "one enqueue, one task");
}

/// A shared library that moves a process's wall clock `SKEW_MS` ahead (`clock_gettime` of
/// the realtime clocks, and `gettimeofday`), for `LD_PRELOAD`; compiled here with gcc.
fn clock_skew_library(dir: &Path) -> Option<std::path::PathBuf> {
    let src = dir.join("skew.c");
    std::fs::write(
        &src,
        r#"#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
static long long skew(void) { const char *s = getenv("SKEW_MS"); return s ? atoll(s) : 0; }
static void add(struct timespec *ts) {
    long long ns = ts->tv_nsec + (skew() % 1000) * 1000000LL;
    ts->tv_sec += skew() / 1000 + ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}
int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) add(ts);
    return r;
}
int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (r == 0 && tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    (void)tz;
    return r;
}
"#,
    )
    .expect("write skew.c");
    let lib = dir.join("skew.so");
    let built = std::process::Command::new("gcc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .status();
    if !built.is_ok_and(|s| s.success()) {
        missing(
            "gcc (to build the clock-skew library)",
            ".ci/run's machine has it",
        );
        return None;
    }
    Some(lib)
}

/// Review item 6: heartbeats were written with each daemon's own wall clock and compared with
/// another's, so a host 60 s ahead took over every running task of a healthy daemon. Leases,
/// heartbeats and recovery now use the server's clock.
#[test]
fn hole_6_a_host_whose_clock_runs_ahead_takes_over_nothing() {
    let Some((pg, _proxy, _via, dir)) = setup("skew") else {
        return;
    };
    let d = dir.path();
    let Some(lib) = clock_skew_library(d) else {
        return;
    };
    for _ in 0..3 {
        enqueue(d, &["--model", "policy"]);
    }
    // A healthy daemon runs all three (each model call takes 1.5 s of real time).
    let url = db_url(d).expect("url");
    let log = std::fs::File::create(d.join("healthy.log")).expect("log");
    let mut healthy = command(d)
        .env("WORKER_DB", &url)
        .env("RUST_LOG", "warn")
        .args(["run", "--max-in-flight", "3", "--time-scale", "1"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the healthy daemon");
    let deadline = Instant::now() + Duration::from_secs(60);
    while pg.psql("SELECT count(*) FROM skew.tasks WHERE status = 'running'") != "3" {
        assert!(
            Instant::now() < deadline,
            "the healthy daemon never ran all three: {}\n{}",
            pg.psql("SELECT string_agg(id || ' ' || status, ', ') FROM skew.tasks"),
            std::fs::read_to_string(d.join("healthy.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A second daemon whose clock is two minutes ahead, past every lease and heartbeat.
    let log = std::fs::File::create(d.join("ahead.log")).expect("log");
    let mut ahead = command(d)
        .env("WORKER_DB", &url)
        .env("RUST_LOG", "warn")
        .env("LD_PRELOAD", &lib)
        .env("SKEW_MS", "120000")
        .args(["run", "--max-in-flight", "1", "--recover-every-ms", "200"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start the daemon that is ahead");
    // It recovers at start and every 200 ms; give it a few rounds while the three run.
    std::thread::sleep(Duration::from_secs(2));
    signal(ahead.id(), "-TERM");
    let _ = ahead.wait();
    let running = pg.psql("SELECT count(*) FROM skew.tasks WHERE status = 'running'");
    let runs = pg.psql("SELECT string_agg(token::text, ',' ORDER BY id) FROM skew.tasks");
    stop(&mut healthy);
    assert_eq!(count_in_logs(d, "ahead", "lease takeover"), 0, "{runs}");
    assert_eq!(
        running, "3",
        "the healthy daemon still runs its three tasks"
    );
    assert_eq!(runs, "1,1,1", "each task was claimed once");
}

/// Review item 7: `--heartbeat-ttl-ms 1000` was accepted but could not be kept: heartbeats
/// were written by the dispatcher between its waits, so a dispatcher held up by the database
/// let its heartbeat run out and two healthy daemons took tasks from each other. The heartbeat
/// now has a thread (and a connection) of its own, and a TTL under 3000 ms is refused.
#[test]
fn hole_7_a_busy_dispatcher_never_lets_its_heartbeat_run_out() {
    let Some((pg, _proxy, _via, dir)) = setup("beat") else {
        return;
    };
    let d = dir.path();
    let (code, err) = fails(d, &["run", "--drain", "--heartbeat-ttl-ms", "1000"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("1000") && err.contains("3000"), "{err}");
    for _ in 0..3 {
        enqueue(d, &["--model", "policy"]);
    }
    let url = db_url(d).expect("url");
    let start = |name: &str, workers: &str| {
        let log = std::fs::File::create(d.join(format!("{name}.log"))).expect("log");
        command(d)
            .env("WORKER_DB", &url)
            .env("RUST_LOG", "warn")
            .args(["run", "--max-in-flight", workers, "--time-scale", "1"])
            .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start a daemon")
    };
    // Daemon a runs the three tasks and has a thread free, so its dispatcher keeps claiming.
    let mut a = start("a", "4");
    let deadline = Instant::now() + Duration::from_secs(60);
    while pg.psql("SELECT count(*) FROM beat.tasks WHERE status = 'running'") != "3" {
        assert!(Instant::now() < deadline, "daemon a never ran all three");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut b = start("b", "1");
    // Every claim waits on the tasks table for 6 s (twice the TTL): so does a's dispatcher.
    pg.psql("BEGIN; LOCK TABLE beat.tasks IN EXCLUSIVE MODE; SELECT pg_sleep(6); COMMIT");
    std::thread::sleep(Duration::from_secs(1));
    let tokens = pg.psql("SELECT string_agg(token::text, ',' ORDER BY id) FROM beat.tasks");
    signal(b.id(), "-TERM");
    let _ = b.wait();
    stop(&mut a);
    assert_eq!(count_in_logs(d, "b", "lease takeover"), 0, "{tokens}");
    assert_eq!(tokens, "1,1,1", "each task was claimed once");
}

/// The read-back of item 4 must not trust its own answer: the review had the enqueue's COMMIT
/// never reach the server (the transaction rolled back) and the read-back's insert of the
/// marker land with its answer lost; the read-back, run again, found its own marker and said
/// "landed": `enqueue` printed t2 for a task that does not exist. Each read-back's marker now
/// carries its nonce.
#[test]
fn hole_4_a_read_back_whose_own_answer_is_lost_still_knows() {
    let Some((pg, proxy, via, dir)) = setup("readback") else {
        return;
    };
    let d = dir.path();
    ok(
        d,
        &[
            "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL,
        ],
    ); // t1, directly
    // The enqueue transaction's COMMIT (after its marker's insert) never arrives; the
    // read-back's insert of the marker lands and its answer is lost.
    proxy.drop_request_after("commits (id, at_ms) VALUES", "COMMIT");
    proxy.lose_answer_to("ON CONFLICT (id) DO NOTHING");
    let out = command(d)
        .env("WORKER_DB", &via)
        .args([
            "enqueue",
            "--model",
            "policy",
            "--user",
            "cu_ana",
            "--goal",
            "the second",
        ])
        .output()
        .expect("enqueue");
    let printed = succeeded(out, &["enqueue", "--model", "policy"]);
    let tasks = pg.psql(
        "SELECT string_agg(id || ' ' || (state->>'goal'), ', ' ORDER BY num) FROM readback.tasks",
    );
    assert_eq!(
        tasks,
        format!("t1 {GOAL}, {} the second", printed.trim()),
        "the acknowledged task exists, once"
    );
    assert!(proxy.lost() >= 1, "the read-back's answer was lost");
}

/// A claim whose connection is cut while it waits on a key's slot row (another claimer holds
/// it): its server process has not noticed and would go on to claim once the row is free,
/// after the daemon read back "nothing". The daemon ends that process before it reads back,
/// so every task the database shows running was handed to a caller.
#[test]
fn a_claim_cut_off_while_it_waits_claims_nothing_behind_the_daemons_back() {
    use tether::store::Queue;
    use tether::store::flow::ConcurrencyLimits;
    let Some(pg) = PgCluster::start("cut_claim") else {
        return;
    };
    let proxy = Proxy::start(pg.port);
    let via = format!(
        "postgres://tether@127.0.0.1:{}/postgres?schema=cut_claim",
        proxy.port
    );
    let store =
        tether::store::pg::PgStore::open(&via, true, 4, Duration::from_secs(20)).expect("open");
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
    let mut other = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let mut tx = other.transaction().expect("begin");
    tx.execute(
        "SELECT running FROM cut_claim.slots WHERE key = 'tenant:acme' FOR UPDATE",
        &[],
    )
    .expect("lock the slot row");
    let store = Arc::new(store);
    let claimer = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || store.claim(&lease, 8, now))
    };
    let mut watch = postgres::Client::connect(&pg.url(), postgres::NoTls).expect("connect");
    let waiting = |w: &mut postgres::Client| -> i64 {
        w.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%slots%'",
            &[],
        )
        .expect("activity")
        .get(0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting(&mut watch) == 0 {
        assert!(
            Instant::now() < deadline,
            "the claim never waited on the slot row"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    proxy.cut();
    std::thread::sleep(Duration::from_millis(300));
    proxy.restore();
    let handed: usize = match claimer.join().expect("claimer") {
        Ok(got) => got.len(),
        Err(e) => panic!("the claim after a cut: {e}"),
    };
    // Free the row; a claim still running on the server would now take its tasks.
    tx.rollback().expect("release");
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting(&mut watch) > 0 {
        assert!(Instant::now() < deadline, "a claim still waits");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let running: i64 = watch
        .query_one(
            "SELECT count(*) FROM cut_claim.tasks WHERE status = 'running'",
            &[],
        )
        .expect("count")
        .get(0);
    assert_eq!(
        running as usize,
        1 + handed,
        "tasks running that no claim handed to its caller"
    );
}
