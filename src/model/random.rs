//! The random model of the design reference's bound check (`random_demo.py`): its replies are
//! typed moves built from the same random numbers as Python's `random.Random(seed)`, drawn in
//! the reference's order.

use serde_json::{Map, json};

use super::Model;
use super::pyrandom::PyRandom;
use crate::kernel::reply::Reply;
use crate::kernel::{ModelReply, ModelRequest, RawReply, ToolCall};

/// The random model of the design reference's bound check (`random_demo.py`), on the same random
/// numbers as Python's `random.Random(seed)`.
pub struct RandomModel {
    rng: PyRandom,
    latency_ms: u64,
}

impl RandomModel {
    pub fn new(seed: u64) -> RandomModel {
        RandomModel::from_rng(PyRandom::new(seed))
    }

    /// The model of a generator already seeded (see [`PyRandom::many`]).
    pub fn from_rng(mut rng: PyRandom) -> RandomModel {
        let latency_ms = *rng.choice(&[500, 1500, 4000]);
        RandomModel { rng, latency_ms }
    }
}

impl Model for RandomModel {
    fn next(&mut self, _req: &ModelRequest<'_>) -> ModelReply {
        let rng = &mut self.rng;
        let r = rng.random();
        // Built as typed moves (the same as the reference's dicts, see `Reply::to_value`):
        // the random numbers are drawn in the reference's order.
        let reply = if r < 0.10 {
            Reply::Final {
                outcome: Some((*rng.choice(&["completed", "cannot_complete"])).into()),
                text: "done".into(),
            }
        } else if r < 0.20 {
            let tool = *rng.choice(&["get_order", "nope"]);
            Reply::Plan {
                steps: json!([{"id": "s1", "tool": tool, "depends_on": []}]),
            }
        } else {
            let tool = *rng.choice(&[
                "get_order",
                "issue_refund",
                "send_status_email",
                "search_policy",
                "delete_order",
            ]);
            let order = *rng.choice(&["ord_1001", "ord_1004", "ord_9999"]);
            let amount = *rng.choice(&[100, 3000, 8000, 99999]);
            let plan_step = *rng.choice(&[None, Some("s1")]);
            let mut args = Map::new();
            args.insert("amount_cents".into(), amount.into());
            args.insert("order_id".into(), order.into());
            Reply::Tool(ToolCall {
                name: tool.into(),
                args,
                plan_step: plan_step.map(str::to_string),
            })
        };
        ModelReply {
            outcome: Ok(RawReply::Move(reply)),
            latency_ms: self.latency_ms,
            usage: None,
            response: None,
            turn: None,
        }
    }
}
