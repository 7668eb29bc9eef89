//! The tool catalog as the kernel sees it: names, read or write, idempotency, and which result
//! fields may become facts. Pure data; the tools themselves live outside the kernel.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub access: Access,
    /// The service replays a stored result for a repeated call key, so a write whose outcome
    /// is unknown after a crash may be retried under the same key.
    pub idempotent: bool,
    /// Result fields copied into facts (an allow-list); anything else in a result is content.
    pub fact_fields: Vec<String>,
    /// The argument whose value prefixes fact names (`ord_1001.total_cents`).
    pub fact_prefix_arg: String,
    /// Phrases for the closing message: what was done, and what was not.
    pub done_phrase: String,
    pub not_done_phrase: String,
}

#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Catalog {
    pub tools: Vec<ToolSpec>,
}

impl Catalog {
    pub fn get(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The document's store: two reads and two writes. Refunds are money, so a refund whose
    /// outcome is unknown is held for reconcile; a status email is safe to retry by key.
    pub fn demo() -> Catalog {
        let spec = |name: &str, access, idempotent, fields: &[&str], done: &str, not_done: &str| {
            ToolSpec {
                name: name.to_string(),
                access,
                idempotent,
                fact_fields: fields.iter().map(|f| f.to_string()).collect(),
                fact_prefix_arg: "order_id".to_string(),
                done_phrase: done.to_string(),
                not_done_phrase: not_done.to_string(),
            }
        };
        Catalog {
            tools: vec![
                spec(
                    "get_order",
                    Access::Read,
                    true,
                    &["order_status", "total_cents", "refunded_cents"],
                    "the order was read",
                    "the order was not read",
                ),
                spec(
                    "search_policy",
                    Access::Read,
                    true,
                    &[],
                    "the policy was looked up",
                    "the policy was not looked up",
                ),
                spec(
                    "issue_refund",
                    Access::Write,
                    false,
                    &["refunded_cents"],
                    "the refund was issued",
                    "the refund was not issued",
                ),
                spec(
                    "send_status_email",
                    Access::Write,
                    true,
                    &["sent"],
                    "the confirmation email was sent",
                    "the confirmation email was not sent",
                ),
            ],
        }
    }
}
