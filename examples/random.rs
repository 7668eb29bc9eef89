//! The document's bound check: 2,000 random models against the default budget, on the same
//! random numbers as `random_demo.py`. Pass a count to run more seeds.

fn main() {
    let runs: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let budget = tether::kernel::Budget::default();
    let sum = tether::sim::random_workload(0..runs, budget);
    print!("{}", tether::sim::demos::random_report(&sum, &budget));
}
