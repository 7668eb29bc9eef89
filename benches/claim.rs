//! The claim rate with 1,000 distinct concurrency keys (each under a limit, so every claim
//! counts and takes slots) beside the rate with no keys, on the redb file and on a throwaway
//! PostgreSQL server, in alternating rounds of one run. Target: at least 0.8x.
//!
//! `cargo bench --bench claim` (TETHER_CLAIM_TASKS sets the tasks per round, default 4,000;
//! claims take 8 tasks at a time, as a daemon with 8 free threads does). On PostgreSQL the
//! tables are as on a live queue (analyzed, the keys' slot rows there);
//! TETHER_CLAIM_FRESH=1 measures tables made a moment ago instead.

#[path = "common/figures.rs"]
mod figures;
use figures::*;
#[path = "common/tasks.rs"]
mod tasks;

#[path = "../tests/it/common/pg.rs"]
#[allow(dead_code)]
mod pg;

use std::time::{Duration, Instant};
use tether::model::ModelProfile;
use tether::store::flow::ConcurrencyLimits;
use tether::store::pg::PgStore;
use tether::store::{Backend, RedbStore};

const KEYS: usize = 1_000;
const ROUNDS: usize = 3;

/// Enqueues `n` tasks (with keys: `k0`..`k999` in turn, each key limited to what it has), runs
/// `loaded`, and claims them all, 8 at a time; claims per second.
fn round(store: &dyn Backend, n: usize, keyed: bool, loaded: &dyn Fn()) -> f64 {
    let mut t = tasks::tasks(&ModelProfile::policy(), n);
    if keyed {
        for (i, task) in t.iter_mut().enumerate() {
            task.concurrency_key = Some(format!("k{}", i % KEYS));
        }
        let per_key = n.div_ceil(KEYS) as u32;
        store.set_limits(ConcurrencyLimits::new([("k*".to_string(), per_key)]).expect("limits"));
    } else {
        store.set_limits(ConcurrencyLimits::default());
    }
    let now = tether::clock::now_ms();
    for chunk in t.chunks(1_000) {
        store.enqueue(chunk, now).expect("enqueue");
    }
    loaded();
    let started = Instant::now();
    let mut claimed = 0;
    loop {
        let got = store
            .claim(&tasks::lease(now), 8, now)
            .expect("claim")
            .len();
        if got == 0 {
            break;
        }
        claimed += got;
    }
    assert_eq!(claimed, n, "every task claimed (keyed: {keyed})");
    claimed as f64 / started.elapsed().as_secs_f64()
}

/// Alternating rounds on fresh databases that `open` makes (`loaded(i)` runs when database
/// `i` is filled); prints the two rates and ratio.
fn compare(
    name: &str,
    n: usize,
    open: &mut dyn FnMut(usize) -> Box<dyn Backend>,
    loaded: &dyn Fn(usize),
) {
    let (mut none, mut keyed) = (Vec::new(), Vec::new());
    for r in 0..ROUNDS {
        let (a, b) = (2 * r, 2 * r + 1);
        none.push(round(open(a).as_ref(), n, false, &|| loaded(a)));
        keyed.push(round(open(b).as_ref(), n, true, &|| loaded(b)));
    }
    let (a, b) = (median(none), median(keyed));
    println!(
        "{name:10}: no keys {a:.0} claims/s, {KEYS} keys {b:.0} claims/s: {:.2}x (median of {ROUNDS} alternating rounds of {n} tasks; target 0.8x)",
        b / a
    );
}

fn main() {
    let n: usize = std::env::var("TETHER_CLAIM_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000);
    let dir = std::env::temp_dir().join(format!("tether-claim-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    compare(
        "redb file",
        n,
        &mut |i| {
            Box::new(RedbStore::open(&dir.join(format!("{i}.redb")), true).expect("a database"))
        },
        &|_| {},
    );
    let _ = std::fs::remove_dir_all(&dir);
    let cluster =
        pg::PgCluster::start_durable("claim").expect("PostgreSQL is needed for this bench");
    let base = cluster.url();
    compare(
        "PostgreSQL",
        n,
        &mut |i| {
            let url = format!("{base}?schema=claim{i}");
            Box::new(PgStore::open(&url, true, 2, Duration::from_secs(10)).expect("a database"))
        },
        &|i| {
            // A live queue, not a database made a moment ago: its keys have slot rows (kept
            // when their tasks end) and autovacuum has analyzed its tables. On tables whose
            // statistics say they are empty the planner probes `slots` by scanning it, until
            // the first ANALYZE; TETHER_CLAIM_FRESH=1 measures that.
            if std::env::var_os("TETHER_CLAIM_FRESH").is_none() {
                cluster.psql(&format!(
                    "INSERT INTO claim{i}.slots (key, running, cap) \
                     SELECT 'k' || g, 0, 1 FROM generate_series(0, {}) g; \
                     ANALYZE claim{i}.tasks, claim{i}.slots",
                    KEYS - 1
                ));
            }
        },
    );
}
