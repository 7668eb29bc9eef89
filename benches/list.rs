//! `worker list --limit 50` over 1,000,000 tasks beside the same over 1,000, in one run: the
//! real binary, each figure the median wall time of several runs and the largest peak RSS of
//! them (from `wait4`). The list reads an index, so the two should be within 2x.
//!
//! `cargo bench --bench list` (TETHER_LIST_BIG sets the large count; the databases are built
//! through the library's enqueue, in batches, in a temporary directory).

#[path = "common/tasks.rs"]
mod tasks;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use tether::model::ModelProfile;
use tether::store::RedbStore;

fn build(path: &Path, n: usize) {
    let store = RedbStore::open(path, true).expect("a database");
    let model = ModelProfile::policy();
    let started = Instant::now();
    let mut left = n;
    while left > 0 {
        let batch = left.min(20_000);
        let mut t = tasks::tasks(&model, batch);
        for (i, task) in t.iter_mut().enumerate() {
            task.user = format!("cu_{}", (left + i) % 1000);
        }
        tether::store::Queue::enqueue(&store, &t, tether::clock::now_ms()).expect("enqueue");
        left -= batch;
    }
    eprintln!(
        "  built {n} tasks in {:.1} s ({} MB)",
        started.elapsed().as_secs_f64(),
        std::fs::metadata(path).map_or(0, |m| m.len() >> 20)
    );
}

/// One run of the binary: wall time in ms and peak RSS in MB.
// The child is reaped by `wait4` (for its rusage), which clippy cannot see.
#[allow(clippy::zombie_processes)]
fn run(db: &Path, args: &[&str]) -> (f64, f64) {
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_worker"))
        .arg("--db")
        .arg(db)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("worker runs");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child, with valid pointers to the status and usage.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(pid, child.id() as i32, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "worker {args:?} failed"
    );
    (ms, usage.ru_maxrss as f64 / 1024.0)
}

fn measure(db: &Path, args: &[&str]) -> (f64, f64) {
    run(db, args); // warm the page cache
    let mut times = Vec::new();
    let mut peak: f64 = 0.0;
    for _ in 0..15 {
        let (ms, mb) = run(db, args);
        times.push(ms);
        peak = peak.max(mb);
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], peak)
}

/// Builds a database in a child process (this binary again), so this process stays small:
/// a child's peak RSS counts the memory of the process that spawned it until its exec.
fn build_in_child(path: &Path, n: usize) {
    let st = Command::new(std::env::current_exe().expect("the bench binary"))
        .env("TETHER_LIST_BUILD", format!("{}={n}", path.display()))
        .status()
        .expect("the builder runs");
    assert!(st.success(), "building {} failed", path.display());
}

fn main() {
    if let Ok(spec) = std::env::var("TETHER_LIST_BUILD") {
        let (path, n) = spec.rsplit_once('=').expect("PATH=N");
        build(Path::new(path), n.parse().expect("N"));
        return;
    }
    let big: usize = std::env::var("TETHER_LIST_BIG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let dir = std::env::temp_dir().join(format!("tether-list-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let small_db: PathBuf = dir.join("small.redb");
    let big_db: PathBuf = dir.join("big.redb");
    eprintln!("building the databases");
    build_in_child(&small_db, 1_000);
    build_in_child(&big_db, big);
    let (_, floor) = measure(&small_db, &["--version"]);
    println!("worker list over the redb file: median of 15 runs, peak RSS of any run");
    println!("(`worker --version` peaks at {floor:.1} MB here: the floor of any run)");
    println!(
        "{:<40} {:>12} {:>12} {:>10} {:>10}",
        "command",
        "1,000 ms",
        format!("{big} ms"),
        "1,000 MB",
        format!("{big} MB")
    );
    for args in [
        &["list", "--limit", "50"][..],
        &["list", "--limit", "50", "--json"],
        &["list", "--limit", "50", "--user", "cu_7"],
        &[
            "list", "--limit", "50", "--status", "queued", "--before", "t500",
        ],
        &["show", "t400"],
    ] {
        let (ms_s, mb_s) = measure(&small_db, args);
        let (ms_b, mb_b) = measure(&big_db, args);
        println!(
            "{:<40} {:>12.1} {:>12.1} {:>10.1} {:>10.1}   time {:.2}x, memory {:.2}x",
            format!("worker {}", args.join(" ")),
            ms_s,
            ms_b,
            mb_s,
            mb_b,
            ms_b / ms_s,
            mb_b / mb_s
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
