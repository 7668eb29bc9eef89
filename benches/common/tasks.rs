//! The task mix both durable benches enqueue: `n` tasks of one model, each with its own store
//! tenant, so no two touch the same order.

use tether::kernel::Budget;
use tether::model::ModelProfile;
use tether::store::{Lease, NewTask};

pub fn tasks(model: &ModelProfile, n: usize) -> Vec<NewTask> {
    (0..n)
        .map(|i| NewTask {
            user: "cu_ana".into(),
            goal: "refund the damaged item on order ord_1001".into(),
            key: None,
            priority: 0,
            budget: Budget::default(),
            model: model.clone(),
            tool_latency_ms: Default::default(),
            store_scope: format!("b{i}"),
            catalog: None,
            approval_wait_ms: tether::store::DEFAULT_APPROVAL_WAIT_MS,
            instructions: None,
            callback_url: None,
            submitted_by: None,
            not_before_ms: None,
            time_limits: Default::default(),
            concurrency_key: None,
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
