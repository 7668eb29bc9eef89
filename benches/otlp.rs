//! Does live OTLP export cost task progress? The same workload (the design reference's Policy, 1000
//! tasks, 4 worker threads, on redb) run with export off, exporting to a receiver that is up
//! (an in-process OTLP/HTTP sink answering 200), and exporting to a receiver that is down
//! (nothing listens: every attempt is refused and retried with backoff). Rounds alternate the
//! order; the medians of steps/s are printed with their ratios to export off.
//!
//! Run with `cargo bench --bench otlp`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tether::store::prelude::*;

use tether::model::ModelProfile;
use tether::otlp::export::Target;
use tether::store::RedbStore;
use tether::tools::durable::DurableStore;
use tether::worker::{self, Config};

#[path = "common/figures.rs"]
mod figures;
use figures::*;
#[path = "common/tasks.rs"]
mod tasks;
use tasks::tasks;

const TASKS: usize = 1000;
const ROUNDS: usize = 7;

fn run(name: &str, otlp: Option<Target>) -> f64 {
    let dir = std::env::temp_dir().join(format!("tether-bench-otlp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let store = Arc::new(RedbStore::open(&dir.join("w.redb"), true).expect("db"));
    let tools = Arc::new(DurableStore::open(&dir.join("w.store.redb")).expect("store"));
    let model = ModelProfile::parse("policy", None).expect("policy");
    store
        .enqueue(&tasks(&model, TASKS), worker::now_ms())
        .expect("enqueue");
    let cfg = Config {
        demo: Some(std::sync::Arc::new(
            tether::tools::durable::DemoShop::opened(std::sync::Arc::clone(&tools)),
        )),
        max_in_flight: 4,
        drain: true,
        otlp,
        ..Config::default()
    };
    let t = Instant::now();
    let stats = worker::run(store, &cfg, Arc::new(AtomicBool::new(false))).expect("run");
    // The drain's time, the exporter's final flush included (a receiver that is up gets what
    // is left before the daemon exits; one that is down is not waited for).
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(stats.tasks_ended.load(Ordering::Relaxed) as usize, TASKS);
    let _ = std::fs::remove_dir_all(&dir);
    stats.steps.load(Ordering::Relaxed) as f64 / secs
}

fn main() {
    // The receiver that is up: counts the requests it accepted.
    let sink = tiny_http::Server::http("127.0.0.1:0").expect("sink");
    let up = format!("http://{}/v1/traces", sink.server_addr());
    let accepted = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for mut req in sink.incoming_requests() {
            let mut body = Vec::new();
            let _ = std::io::Read::read_to_end(req.as_reader(), &mut body);
            count.fetch_add(1, Ordering::Relaxed);
            let _ = req.respond(tiny_http::Response::empty(200));
        }
    });
    // The receiver that is down: a port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let down = format!("http://{}/v1/traces", closed.local_addr().expect("addr"));
    drop(closed);
    let target = |url: &str| Target {
        url: url.to_string(),
        headers: Vec::new(),
        timeout: Duration::from_secs(10),
        backlog_max: tether::otlp::export::BACKLOG_MAX,
        config: Arc::default(),
    };
    let (mut off, mut on, mut dead) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let mut order: Vec<u8> = vec![0, 1, 2];
        order.rotate_left(round % 3);
        for which in order {
            match which {
                0 => off.push(run("off", None)),
                1 => on.push(run("up", Some(target(&up)))),
                _ => dead.push(run("down", Some(target(&down)))),
            }
        }
    }
    let (off, on, dead) = (median(off), median(on), median(dead));
    println!("live OTLP export, {TASKS} Policy tasks, 4 threads, redb, median of {ROUNDS} rounds");
    println!("  export off:                {off:8.0} steps/s");
    println!(
        "  export to a receiver up:   {on:8.0} steps/s  ({:.2}x of off; {} requests accepted)",
        on / off,
        accepted.load(Ordering::Relaxed)
    );
    println!(
        "  export to a receiver down: {dead:8.0} steps/s  ({:.2}x of off)",
        dead / off
    );
}
