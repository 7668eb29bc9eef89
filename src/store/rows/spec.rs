//! The spec row: what enqueue fixes (key, model, tool settings, catalog, namespace, enqueued
//! budget, instructions, callback URL, submitter, concurrency key, time limits), written
//! once; format 8, and the older formats it still reads.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::{BudgetRowV1, ModelRow};
use crate::kernel::Budget;

/// What enqueue fixes: written once. Script replies and catalogs are blobs, by digest.
/// Format 8 ([`SPEC_FORMAT`]): format 7 with the time limits; format 7 is format 6 with the
/// concurrency key; format 6 is format 5 with
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
    pub time_limits: crate::store::TimeLimits,
}

/// The format a spec row is written in.
pub const SPEC_FORMAT: u8 = 8;

/// A spec row of format 7 (before time limits).
#[derive(Serialize, Deserialize)]
pub struct SpecRowV7 {
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

impl From<SpecRowV7> for SpecRow {
    fn from(o: SpecRowV7) -> SpecRow {
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
            concurrency_key: o.concurrency_key,
            time_limits: Default::default(),
        }
    }
}

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

impl From<SpecRowV6> for SpecRowV7 {
    fn from(o: SpecRowV6) -> SpecRowV7 {
        SpecRowV7 {
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

impl From<SpecRowV5> for SpecRowV6 {
    fn from(o: SpecRowV5) -> SpecRowV6 {
        SpecRowV6 {
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
        }
    }
}

impl From<SpecRowV4> for SpecRowV5 {
    fn from(o: SpecRowV4) -> SpecRowV5 {
        SpecRowV5 {
            key: o.key,
            model: o.model,
            tool_latency_ms: o.tool_latency_ms,
            catalog: o.catalog,
            store_scope: o.store_scope,
            created_at_ms: o.created_at_ms,
            key_ns: o.key_ns,
            enqueued_budget: o.enqueued_budget.map(Budget::from),
            instructions: o.instructions,
        }
    }
}

impl From<SpecRowV3> for SpecRowV4 {
    fn from(o: SpecRowV3) -> SpecRowV4 {
        SpecRowV4 {
            key: o.key,
            model: o.model,
            tool_latency_ms: o.tool_latency_ms,
            catalog: o.catalog,
            store_scope: o.store_scope,
            created_at_ms: o.created_at_ms,
            key_ns: o.key_ns,
            enqueued_budget: o.enqueued_budget,
            instructions: None,
        }
    }
}

impl From<SpecRowV2> for SpecRowV3 {
    fn from(o: SpecRowV2) -> SpecRowV3 {
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
}

/// A stored spec row of format 8, or of an older format read as one: each older format is
/// lifted one format at a time (format 7 gains time limits, 6 a concurrency key, 5 a callback
/// and submitter, 4 the default replan budget, 3 no instructions, 2 no namespace or enqueued
/// budget: the task's keys use the database id).
pub fn decode_spec(what: &str, bytes: &[u8]) -> std::result::Result<SpecRow, crate::store::Error> {
    use crate::store::codec::decode_payload as de;
    crate::store::codec::decode_row_versioned(what, bytes, SPEC_FORMAT, |version, payload| {
        let v6: SpecRowV6 = match version {
            7 => return Ok(de::<SpecRowV7>(what, payload)?.into()),
            6 => de(what, payload)?,
            5 => de::<SpecRowV5>(what, payload)?.into(),
            4 => SpecRowV5::from(de::<SpecRowV4>(what, payload)?).into(),
            3 => SpecRowV5::from(SpecRowV4::from(de::<SpecRowV3>(what, payload)?)).into(),
            2 => {
                let v3 = SpecRowV3::from(de::<SpecRowV2>(what, payload)?);
                SpecRowV5::from(SpecRowV4::from(v3)).into()
            }
            _ => {
                return Err(crate::store::Error::Corrupt(format!(
                    "{what} record: unknown record format {version}"
                )));
            }
        };
        Ok(SpecRowV7::from(v6).into())
    })
}
