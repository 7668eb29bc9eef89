//! The task mix both durable benches enqueue: `n` tasks of one model, each with its own store
//! tenant, so no two touch the same order.

use tether::model::ModelProfile;
use tether::store::{Lease, NewTask};

pub fn tasks(model: &ModelProfile, n: usize) -> Vec<NewTask> {
    (0..n)
        .map(|i| NewTask {
            store_scope: format!("b{i}"),
            ..NewTask::of(
                "cu_ana",
                "refund the damaged item on order ord_1001",
                model.clone(),
            )
        })
        .collect()
}

/// A claim's lease for a bench's own claims: ten minutes from `now`, in this process's name.
#[allow(dead_code)]
pub fn lease(now: u64) -> Lease {
    Lease {
        owner: "bench".into(),
        host: "bench".into(),
        pid: std::process::id(),
        start_ticks: 0,
        expires_at_ms: now + 600_000,
        token: 0,
    }
}
