//! Benchmark: the design reference's 2,000-random-model workload, in memory, against the Python
//! reference measured in the same run on the same machine. Prints runs/s and steps/s for both
//! and their ratio. Run with `cargo bench --bench kernel`.
//!
//! The reference is timed inside its own interpreter (`time.perf_counter()` around the import
//! of `random_demo.py`, which runs the workload), so interpreter start-up is not counted
//! against it. Both sides run the very same 2,000 models (same seeds, same random numbers), and
//! the bench checks that they print the same report before it prints a ratio.

/// The allocator the worker binary runs on (`src/bin/worker.rs`), so the bench measures what ships.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::Command;
use std::time::Instant;

use tether::kernel::Budget;
use tether::sim::{demos::random_report, random_workload};

fn reference_dir() -> Option<std::path::PathBuf> {
    let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    [
        manifest.join("../shared/reference"),
        manifest.join("../../shared/reference"),
    ]
    .into_iter()
    .find(|p| p.join("random_demo.py").exists())
}

fn main() {
    let budget = Budget::default();
    let runs = 2000u64;
    // Warm up, then take the best of several rounds: the machine is shared and noisy.
    let _ = random_workload(0..runs, budget);
    let mut best = f64::INFINITY;
    let mut sum = random_workload(0..runs, budget);
    for _ in 0..10 {
        let t = Instant::now();
        sum = random_workload(0..runs, budget);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let rust_runs_s = runs as f64 / best;
    let rust_steps_s = sum.steps as f64 / best;
    println!(
        "tether kernel : {runs} runs, {} steps in {:.4} s: {:.0} runs/s, {:.0} steps/s",
        sum.steps, best, rust_runs_s, rust_steps_s
    );

    let Some(dir) = reference_dir() else {
        println!("reference not found next to the repo (../shared/reference): no ratio");
        return;
    };
    let script = "import sys, time, io, contextlib\nbest = 1e9\nfor _ in range(3):\n    for m in [k for k in sys.modules if k in ('random_demo', 'scenarios', 'loop', 'kernel', 'tools', 'models')]: del sys.modules[m]\n    buf = io.StringIO()\n    t = time.perf_counter()\n    with contextlib.redirect_stdout(buf):\n        import random_demo\n    best = min(best, time.perf_counter() - t)\nprint(best)\nprint(buf.getvalue(), end='')\n";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .current_dir(&dir)
        .output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else {
        println!("python3 could not run the reference: no ratio");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let (secs, report) = text.split_once('\n').unwrap_or(("nan", ""));
    let py_secs: f64 = secs.trim().parse().unwrap_or(f64::NAN);
    let py_runs_s = runs as f64 / py_secs;
    let py_steps_s = sum.steps as f64 / py_secs;
    println!(
        "python ref    : {runs} runs, {} steps in {:.4} s: {:.0} runs/s, {:.0} steps/s",
        sum.steps, py_secs, py_runs_s, py_steps_s
    );
    let same = report == random_report(&sum, &budget);
    println!("same report as the reference: {same}");
    println!(
        "ratio         : {:.1}x runs/s (target: at least 25x)",
        rust_runs_s / py_runs_s
    );
}
