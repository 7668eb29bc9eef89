//! The spec row: what enqueue fixes (key, model, tool settings, catalog, namespace, enqueued
//! budget, instructions, callback URL, submitter, concurrency key), written once; format 7,
//! and the older formats it still reads.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::{BudgetRowV1, ModelRow};
use crate::kernel::Budget;

/// What enqueue fixes: written once. Script replies and catalogs are blobs, by digest.
/// Format 7 ([`SPEC_FORMAT`]): format 6 with the concurrency key; format 6 is format 5 with
/// the callback URL and the API submitter; format 5
/// is format 4 with the budget's `replans_max`; format 4 is format 3 and the task's own agent
/// instructions.
#[derive(Serialize, Deserialize)]
pub struct SpecRow {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
    pub key_ns: Option<String>,
    pub enqueued_budget: Option<Budget>,
    pub instructions: Option<String>,
    pub callback_url: Option<String>,
    pub submitted_by: Option<String>,
    pub concurrency_key: Option<String>,
}

/// The format a spec row is written in.
pub const SPEC_FORMAT: u8 = 7;

/// A spec row of format 6 (before concurrency keys).
#[derive(Serialize, Deserialize)]
pub struct SpecRowV6 {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
    pub key_ns: Option<String>,
    pub enqueued_budget: Option<Budget>,
    pub instructions: Option<String>,
    pub callback_url: Option<String>,
    pub submitted_by: Option<String>,
}

/// A spec row of format 5 (before callbacks and API submitters).
#[derive(Serialize, Deserialize)]
pub struct SpecRowV5 {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
    pub key_ns: Option<String>,
    pub enqueued_budget: Option<Budget>,
    pub instructions: Option<String>,
}

/// A spec row of format 4 (before the budget had `replans_max`).
#[derive(Serialize, Deserialize)]
pub struct SpecRowV4 {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
    pub key_ns: Option<String>,
    pub enqueued_budget: Option<BudgetRowV1>,
    pub instructions: Option<String>,
}

/// A spec row of format 3: format 2 and the task's call-key namespace and enqueued budget.
#[derive(Serialize, Deserialize)]
pub struct SpecRowV3 {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
    pub key_ns: Option<String>,
    pub enqueued_budget: Option<BudgetRowV1>,
}

/// A spec row of format 2 (before namespaces and enqueued budgets were kept).
#[derive(Serialize, Deserialize)]
pub struct SpecRowV2 {
    pub key: Option<String>,
    pub model: ModelRow,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<String>,
    pub store_scope: String,
    pub created_at_ms: u64,
}

/// A spec row as stored.
pub fn encode_spec(spec: &SpecRow) -> std::result::Result<Vec<u8>, crate::store::Error> {
    crate::store::codec::encode_row_as(SPEC_FORMAT, spec)
}

impl From<SpecRowV6> for SpecRow {
    fn from(o: SpecRowV6) -> SpecRow {
        SpecRow {
            key: o.key,
            model: o.model,
            tool_latency_ms: o.tool_latency_ms,
            catalog: o.catalog,
            store_scope: o.store_scope,
            created_at_ms: o.created_at_ms,
            key_ns: o.key_ns,
            enqueued_budget: o.enqueued_budget,
            instructions: o.instructions,
            callback_url: o.callback_url,
            submitted_by: o.submitted_by,
            concurrency_key: None,
        }
    }
}

/// A stored spec row of format 7, or of an older format read as one: format 6 without a
/// concurrency key, format 5 also without a
/// callback or submitter, format 4 also with the default replan budget, format 3 also without instructions, format 2 also without a
/// namespace or an enqueued budget (the task's keys use the database id).
pub fn decode_spec(what: &str, bytes: &[u8]) -> std::result::Result<SpecRow, crate::store::Error> {
    crate::store::codec::decode_row_versioned(what, bytes, SPEC_FORMAT, |version, payload| {
        if version == 6 {
            let o: SpecRowV6 = crate::store::codec::decode_payload(what, payload)?;
            return Ok(o.into());
        }
        if version == 5 {
            let o: SpecRowV5 = crate::store::codec::decode_payload(what, payload)?;
            return Ok(SpecRow {
                key: o.key,
                model: o.model,
                tool_latency_ms: o.tool_latency_ms,
                catalog: o.catalog,
                store_scope: o.store_scope,
                created_at_ms: o.created_at_ms,
                key_ns: o.key_ns,
                enqueued_budget: o.enqueued_budget,
                instructions: o.instructions,
                callback_url: None,
                submitted_by: None,
                concurrency_key: None,
            });
        }
        if version == 4 {
            let o: SpecRowV4 = crate::store::codec::decode_payload(what, payload)?;
            return Ok(SpecRow {
                key: o.key,
                model: o.model,
                tool_latency_ms: o.tool_latency_ms,
                catalog: o.catalog,
                store_scope: o.store_scope,
                created_at_ms: o.created_at_ms,
                key_ns: o.key_ns,
                enqueued_budget: o.enqueued_budget.map(Budget::from),
                instructions: o.instructions,
                callback_url: None,
                submitted_by: None,
                concurrency_key: None,
            });
        }
        let old: SpecRowV3 = match version {
            3 => crate::store::codec::decode_payload(what, payload)?,
            2 => {
                let o: SpecRowV2 = crate::store::codec::decode_payload(what, payload)?;
                SpecRowV3 {
                    key: o.key,
                    model: o.model,
                    tool_latency_ms: o.tool_latency_ms,
                    catalog: o.catalog,
                    store_scope: o.store_scope,
                    created_at_ms: o.created_at_ms,
                    key_ns: None,
                    enqueued_budget: None,
                }
            }
            _ => {
                return Err(crate::store::Error::Corrupt(format!(
                    "{what} record: unknown record format {version}"
                )));
            }
        };
        Ok(SpecRow {
            key: old.key,
            model: old.model,
            tool_latency_ms: old.tool_latency_ms,
            catalog: old.catalog,
            store_scope: old.store_scope,
            created_at_ms: old.created_at_ms,
            key_ns: old.key_ns,
            enqueued_budget: old.enqueued_budget.map(Budget::from),
            instructions: None,
            callback_url: None,
            submitted_by: None,
            concurrency_key: None,
        })
    })
}
