//! Tools: the `Tools` trait and the demo shop backend.
//!
//! The store has orders, refunds with an automatic limit and approval of exact arguments,
//! status emails, and a stored result per call key that a repeated write gets back instead of a
//! second effect. Its rules live in [`apply`], a pure function over the order book, so the
//! in-memory [`DemoStore`] and the durable one on redb behave the same.
//!
//! A write that outlives its timeout still happens here; the kernel, which knows the timeout,
//! reports its outcome as unknown. That is what a lost response from a real service looks like.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::kernel::json::py_str_repr;
use crate::kernel::{ToolReply, ToolRequest};

pub trait Tools {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply;
}

/// Refunds above this many cents need a person's approval of the exact arguments.
pub const AUTO_LIMIT_CENTS: i64 = 5000;
/// Time a replayed result takes.
pub const REPLAY_LATENCY_MS: u64 = 100;

/// A tool's simulated latency: the task's override, else the design reference's figure.
pub fn latency_ms(tool: &str, override_ms: Option<u64>) -> u64 {
    override_ms.unwrap_or_else(|| default_latency_ms(tool))
}

pub fn default_latency_ms(tool: &str) -> u64 {
    match tool {
        "get_order" => 400,
        "search_policy" => 800,
        "issue_refund" => 1200,
        "send_status_email" => 900,
        _ => 500,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    pub customer: String,
    pub total: i64,
    pub refunded: i64,
    pub status: String,
}

/// An effect in the store's ledger.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Effect {
    Refund { order: String, amount_cents: i64 },
    Email { order: String },
}

impl Effect {
    /// As the design reference prints it: `('refund', 'ord_1001', 3000)`.
    pub fn to_python(&self) -> String {
        match self {
            Effect::Refund {
                order,
                amount_cents,
            } => format!("('refund', {}, {amount_cents})", py_str_repr(order)),
            Effect::Email { order } => format!("('email', {})", py_str_repr(order)),
        }
    }
}

pub fn effects_to_python(effects: &[Effect]) -> String {
    let parts: Vec<String> = effects.iter().map(Effect::to_python).collect();
    format!("[{}]", parts.join(", "))
}

/// The design reference's two orders, both Ana's.
pub fn demo_orders() -> BTreeMap<String, Order> {
    let order = |total| Order {
        customer: "cu_ana".into(),
        total,
        refunded: 0,
        status: "delivered".into(),
    };
    BTreeMap::from([
        ("ord_1001".to_string(), order(4200)),
        ("ord_1004".to_string(), order(15000)),
    ])
}

fn err(code: &str) -> Value {
    json!({"status": "error", "code": code})
}

/// The store's rules for one call. Returns the result and, for a write that took effect, the
/// effect to append to the ledger. `approved` answers whether (tool, digest) was approved.
pub fn apply(
    orders: &mut BTreeMap<String, Order>,
    approved: &dyn Fn(&str, &str) -> bool,
    user: &str,
    name: &str,
    args: &Map<String, Value>,
) -> (Value, Option<Effect>) {
    if name == "search_policy" {
        static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let text =
            TEXT.get_or_init(|| "Returns are accepted within 30 days of delivery. ".repeat(90));
        return (json!({"status": "ok", "text": text}), None);
    }
    if !matches!(name, "get_order" | "issue_refund" | "send_status_email") {
        return (err("unknown_tool"), None);
    }
    let order_id = args.get("order_id").and_then(Value::as_str).unwrap_or("");
    let Some(rec) = orders.get_mut(order_id).filter(|r| r.customer == user) else {
        return (err("not_found"), None);
    };
    match name {
        "get_order" => (
            json!({"status": "ok", "order_status": rec.status, "total_cents": rec.total,
                   "refunded_cents": rec.refunded}),
            None,
        ),
        "issue_refund" => {
            let Some(amount) = args
                .get("amount_cents")
                .and_then(Value::as_i64)
                .filter(|a| *a > 0)
            else {
                return (
                    json!({"status": "error", "code": "invalid_args",
                           "detail": "amount_cents must be a positive whole number"}),
                    None,
                );
            };
            if amount > rec.total - rec.refunded {
                return (
                    json!({"status": "error", "code": "invalid_state", "detail": "amount exceeds refundable"}),
                    None,
                );
            }
            if amount > AUTO_LIMIT_CENTS
                && !approved(name, &crate::kernel::state::digest(name, args))
            {
                return (json!({"status": "needs_approval"}), None);
            }
            rec.refunded += amount;
            (
                json!({"status": "ok", "refunded_cents": rec.refunded}),
                Some(Effect::Refund {
                    order: order_id.to_string(),
                    amount_cents: amount,
                }),
            )
        }
        _ => (
            json!({"status": "ok", "sent": true}),
            Some(Effect::Email {
                order: order_id.to_string(),
            }),
        ),
    }
}

/// The design reference's fake backend, in memory.
#[derive(Debug)]
pub struct DemoStore {
    pub orders: BTreeMap<String, Order>,
    pub effects: Vec<Effect>,
    /// Stored results of writes that succeeded: call key -> tool -> result.
    pub done: HashMap<String, HashMap<String, Value>>,
    /// Approved (tool, digest of tool and args).
    pub approved: BTreeSet<(String, String)>,
    pub latency_ms: HashMap<String, u64>,
}

impl Default for DemoStore {
    fn default() -> Self {
        DemoStore::new()
    }
}

impl DemoStore {
    pub fn new() -> DemoStore {
        DemoStore {
            orders: demo_orders(),
            effects: Vec::new(),
            done: HashMap::new(),
            approved: BTreeSet::new(),
            latency_ms: HashMap::new(),
        }
    }

    pub fn with_latency(mut self, tool: &str, ms: u64) -> DemoStore {
        self.latency_ms.insert(tool.to_string(), ms);
        self
    }

    pub fn approve(&mut self, tool: &str, digest: &str) {
        self.approved.insert((tool.to_string(), digest.to_string()));
    }

    /// Invariant of the store: no order is refunded beyond its total.
    pub fn refunds_within_totals(&self) -> bool {
        self.orders.values().all(|o| o.refunded <= o.total)
    }
}

impl Tools for DemoStore {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        let name = req.call.name.as_str();
        if let Some(stored) = self.done.get(req.key).and_then(|m| m.get(name)) {
            let mut replay = stored.clone();
            if let Some(o) = replay.as_object_mut() {
                o.insert("replayed".into(), Value::Bool(true));
            }
            return ToolReply {
                result: replay,
                latency_ms: REPLAY_LATENCY_MS,
            };
        }
        let approved = &self.approved;
        let is_approved = |t: &str, d: &str| approved.contains(&(t.to_string(), d.to_string()));
        let (result, effect) = apply(
            &mut self.orders,
            &is_approved,
            req.user_id,
            name,
            &req.call.args,
        );
        if let Some(e) = effect {
            self.effects.push(e);
            self.done
                .entry(req.key.to_string())
                .or_default()
                .insert(name.to_string(), result.clone());
        }
        ToolReply {
            result,
            latency_ms: latency_ms(name, self.latency_ms.get(name).copied()),
        }
    }
}

pub mod approval;
pub mod durable;
pub mod http;
pub mod request;
pub mod service;
