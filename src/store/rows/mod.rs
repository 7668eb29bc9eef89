//! The rows of the worker database: what [`super::codec`] stores for each domain value.
//!
//! A task is two rows and shared blobs: the task row (queue status, lease, budget, state: what
//! a step or an operator changes), written by every step; the spec row (key, model, tool
//! settings, creation time: fixed at enqueue), written once; and content-addressed blobs for a
//! script's replies and a tool catalog, stored once however many tasks share them. A step
//! commit so writes the state and what the step added, never the script or the catalog again.
//!
//! Rows are plain structs; dynamic values are [`Json`] text. Field order is the format:
//! change it only with a new record version.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

mod reply;
mod spec;
mod task;

pub use spec::{SPEC_FORMAT, SpecRow, decode_spec, encode_spec};

pub use task::{StateRow, TaskRow, decode_task, encode_task};

use super::codec::{Json, Record};
use super::{CallRecord, TaskRecord};
use crate::kernel::memory::Note;
use crate::kernel::{Budget, Catalog, Span, SpanKind, TaskState, ToolCall};
use crate::model::ModelProfile;
use crate::store::Event;

type R<T> = std::result::Result<T, String>;

/// A budget as rows before `replans_max` stored it (task formats 2 and 3, spec formats 3
/// and 4): read with the default replan budget.
#[derive(Clone, Copy, Serialize, Deserialize)]
pub struct BudgetRowV1 {
    steps_max: u32,
    tool_calls_max: u32,
    tokens_max: u64,
    output_tokens_max: u32,
    deadline_ms: u64,
    repeat_max: u32,
    stalls_max: u32,
    plan_steps_max: u32,
}

impl From<BudgetRowV1> for Budget {
    fn from(b: BudgetRowV1) -> Budget {
        Budget {
            steps_max: b.steps_max,
            tool_calls_max: b.tool_calls_max,
            tokens_max: b.tokens_max,
            output_tokens_max: b.output_tokens_max,
            deadline_ms: b.deadline_ms,
            repeat_max: b.repeat_max,
            stalls_max: b.stalls_max,
            plan_steps_max: b.plan_steps_max,
            replans_max: Budget::default().replans_max,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub struct ToolCallRow {
    name: String,
    args: Json,
    plan_step: Option<String>,
}

impl Record for ToolCall {
    type Row = ToolCallRow;
    fn to_row(&self) -> ToolCallRow {
        ToolCallRow {
            name: self.name.clone(),
            args: Json::of_map(&self.args),
            plan_step: self.plan_step.clone(),
        }
    }
    fn from_row(r: ToolCallRow) -> R<ToolCall> {
        Ok(ToolCall {
            name: r.name,
            args: r.args.map()?,
            plan_step: r.plan_step,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub enum ModelRow {
    Policy {
        order: String,
        amount_cents: i64,
        latency_ms: u64,
    },
    SameCall {
        latency_ms: u64,
    },
    NewIds {
        latency_ms: u64,
    },
    SearchLoop {
        latency_ms: u64,
    },
    /// The replies are the blob under this digest.
    Script {
        replies: String,
        latency_ms: u64,
    },
    OpenAi {
        base_url: String,
        model: String,
        api_key_env: Option<String>,
        max_retries: u32,
        temperature: f64,
    },
    /// A profile of the daemon's config, by name (spec format 3).
    Profile {
        name: String,
    },
}

/// Content shared by tasks, stored once under its digest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Blob {
    /// A script model's replies.
    Replies(Vec<Json>),
    /// A tool catalog, as canonical JSON (it is config, read at enqueue).
    Catalog(Json),
}

impl Blob {
    /// `script:` or `catalog:` and 32 hex digits of the SHA-256 of the content.
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        let prefix = match self {
            Blob::Replies(rs) => {
                for r in rs {
                    h.update(r.0.as_bytes());
                    h.update(b"\n");
                }
                "script"
            }
            Blob::Catalog(c) => {
                h.update(c.0.as_bytes());
                "catalog"
            }
        };
        format!(
            "{prefix}:{}",
            crate::kernel::state::hex_prefix(&h.finalize(), 32)
        )
    }
}

/// A task record split into its rows and the blobs it refers to.
pub struct Split {
    pub row: TaskRow,
    pub spec: SpecRow,
    pub blobs: Vec<(String, Blob)>,
}

pub fn task_row(rec: &TaskRecord) -> TaskRow {
    TaskRow {
        id: rec.id.clone(),
        status: rec.status,
        priority: rec.priority,
        budget: rec.budget,
        state: rec.state.to_row(),
        next_span_id: rec.next_span_id,
        updated_at_ms: rec.updated_at_ms,
        lease: rec.lease.clone(),
        runs: rec.runs,
        cancel_requested: rec.cancel_requested.clone(),
        settle: rec.settle.as_ref().map(Json::of),
        approval_wait_ms: rec.approval_wait_ms,
        suspended_at_ms: rec.suspended_at_ms,
        approval: rec.approval.clone(),
        not_before_ms: rec.not_before_ms,
    }
}

pub fn split(rec: &TaskRecord) -> Split {
    let mut blobs = Vec::new();
    let mut blob = |b: Blob| {
        let d = b.digest();
        blobs.push((d.clone(), b));
        d
    };
    let model = match &rec.model {
        ModelProfile::Policy {
            order,
            amount_cents,
            latency_ms,
        } => ModelRow::Policy {
            order: order.clone(),
            amount_cents: *amount_cents,
            latency_ms: *latency_ms,
        },
        ModelProfile::SameCall { latency_ms } => ModelRow::SameCall {
            latency_ms: *latency_ms,
        },
        ModelProfile::NewIds { latency_ms } => ModelRow::NewIds {
            latency_ms: *latency_ms,
        },
        ModelProfile::SearchLoop { latency_ms } => ModelRow::SearchLoop {
            latency_ms: *latency_ms,
        },
        ModelProfile::Script {
            replies,
            latency_ms,
        } => ModelRow::Script {
            replies: blob(Blob::Replies(replies.iter().map(Json::of).collect())),
            latency_ms: *latency_ms,
        },
        ModelProfile::OpenAi {
            base_url,
            model,
            api_key_env,
            max_retries,
            temperature,
        } => ModelRow::OpenAi {
            base_url: base_url.clone(),
            model: model.clone(),
            api_key_env: api_key_env.clone(),
            max_retries: *max_retries,
            temperature: *temperature,
        },
        ModelProfile::Profile { name } => ModelRow::Profile { name: name.clone() },
    };
    let catalog = rec.catalog.as_ref().map(|c| {
        let text = serde_json::to_value(c).map_or_else(|_| Json("null".into()), |v| Json::of(&v));
        blob(Blob::Catalog(text))
    });
    Split {
        row: task_row(rec),
        spec: SpecRow {
            key: rec.key.clone(),
            model,
            tool_latency_ms: rec.tool_latency_ms.clone(),
            catalog,
            store_scope: rec.store_scope.clone(),
            created_at_ms: rec.created_at_ms,
            key_ns: rec.key_ns.clone(),
            enqueued_budget: rec.enqueued_budget,
            instructions: rec.instructions.clone(),
            callback_url: rec.callback_url.clone(),
            submitted_by: rec.submitted_by.clone(),
            concurrency_key: rec.concurrency_key.clone(),
            time_limits: rec.time_limits,
        },
        blobs,
    }
}

/// A spec's model row as the model it names; a script's replies read from their blob.
fn model_of(m: ModelRow, blob: &mut dyn FnMut(&str) -> R<Blob>) -> R<ModelProfile> {
    Ok(match m {
        ModelRow::Policy {
            order,
            amount_cents,
            latency_ms,
        } => ModelProfile::Policy {
            order,
            amount_cents,
            latency_ms,
        },
        ModelRow::SameCall { latency_ms } => ModelProfile::SameCall { latency_ms },
        ModelRow::NewIds { latency_ms } => ModelProfile::NewIds { latency_ms },
        ModelRow::SearchLoop { latency_ms } => ModelProfile::SearchLoop { latency_ms },
        ModelRow::Script {
            replies,
            latency_ms,
        } => match blob(&replies)? {
            Blob::Replies(rs) => ModelProfile::Script {
                replies: rs.iter().map(Json::value).collect::<R<_>>()?,
                latency_ms,
            },
            Blob::Catalog(_) => return Err(format!("blob {replies} is not a script")),
        },
        ModelRow::OpenAi {
            base_url,
            model,
            api_key_env,
            max_retries,
            temperature,
        } => ModelProfile::OpenAi {
            base_url,
            model,
            api_key_env,
            max_retries,
            temperature,
        },
        ModelRow::Profile { name } => ModelProfile::Profile { name },
    })
}

/// A spec's catalog, read from its blob (once for all the tasks in memory that share it).
fn catalog_of(
    digest: Option<&str>,
    blob: &mut dyn FnMut(&str) -> R<Blob>,
) -> R<Option<Arc<Catalog>>> {
    let Some(d) = digest else { return Ok(None) };
    shared_catalog(d, || match blob(d)? {
        Blob::Catalog(text) => serde_json::from_value::<Catalog>(text.value()?)
            .map_err(|e| format!("blob {d}: not a tool catalog: {e}")),
        Blob::Replies(_) => Err(format!("blob {d} is not a catalog")),
    })
    .map(Some)
}

/// The catalog of `digest` as held in memory: the copy tasks already hold, if any; otherwise
/// `read`'s, kept for the next task of that catalog while one holds it. Ten thousand tasks of
/// one catalog in flight hold one copy, not ten thousand.
pub fn shared_catalog(digest: &str, read: impl FnOnce() -> R<Catalog>) -> R<Arc<Catalog>> {
    static HELD: Mutex<BTreeMap<String, Weak<Catalog>>> = Mutex::new(BTreeMap::new());
    if let Some(c) = lock(&HELD).get(digest).and_then(Weak::upgrade) {
        return Ok(c);
    }
    let c = Arc::new(read()?);
    let mut held = lock(&HELD);
    // Catalogs no task holds any more are forgotten here, at the next one read.
    held.retain(|_, w| w.strong_count() > 0);
    held.insert(digest.to_string(), Arc::downgrade(&c));
    Ok(c)
}

/// The digest a catalog is stored under (the blob of its canonical JSON).
pub fn catalog_digest(c: &Catalog) -> String {
    let text = serde_json::to_value(c).map_or_else(|_| Json("null".into()), |v| Json::of(&v));
    Blob::Catalog(text).digest()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Puts a task record together from its rows; `blob` finds a blob by digest.
pub fn join(row: TaskRow, spec: SpecRow, blob: &mut dyn FnMut(&str) -> R<Blob>) -> R<TaskRecord> {
    let model = model_of(spec.model, blob)?;
    let catalog = catalog_of(spec.catalog.as_deref(), blob)?;
    Ok(TaskRecord {
        id: row.id,
        status: row.status,
        priority: row.priority,
        key: spec.key,
        budget: row.budget,
        model,
        tool_latency_ms: spec.tool_latency_ms,
        catalog,
        store_scope: spec.store_scope,
        state: TaskState::from_row(row.state)?,
        next_span_id: row.next_span_id,
        created_at_ms: spec.created_at_ms,
        updated_at_ms: row.updated_at_ms,
        lease: row.lease,
        runs: row.runs,
        cancel_requested: row.cancel_requested,
        settle: row.settle.map(|j| j.value()).transpose()?,
        approval_wait_ms: row.approval_wait_ms,
        suspended_at_ms: row.suspended_at_ms,
        approval: row.approval,
        key_ns: spec.key_ns,
        enqueued_budget: spec.enqueued_budget,
        instructions: spec.instructions,
        callback_url: spec.callback_url,
        submitted_by: spec.submitted_by,
        not_before_ms: row.not_before_ms,
        concurrency_key: spec.concurrency_key,
        time_limits: spec.time_limits,
    })
}

#[derive(Serialize, Deserialize)]
pub struct CallRow {
    key: String,
    task_id: String,
    step: u32,
    tool: String,
    args: Json,
    digest: String,
    intent_at_ms: u64,
    result: Option<Json>,
    result_at_ms: Option<u64>,
}

impl Record for CallRecord {
    type Row = CallRow;
    fn to_row(&self) -> CallRow {
        CallRow {
            key: self.key.clone(),
            task_id: self.task_id.clone(),
            step: self.step,
            tool: self.tool.clone(),
            args: Json::of_map(&self.args),
            digest: self.digest.clone(),
            intent_at_ms: self.intent_at_ms,
            result: self.result.as_ref().map(Json::of),
            result_at_ms: self.result_at_ms,
        }
    }
    fn from_row(r: CallRow) -> R<CallRecord> {
        Ok(CallRecord {
            key: r.key,
            task_id: r.task_id,
            step: r.step,
            tool: r.tool,
            args: r.args.map()?,
            digest: r.digest,
            intent_at_ms: r.intent_at_ms,
            result: r.result.map(|j| j.value()).transpose()?,
            result_at_ms: r.result_at_ms,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub struct SpanRow {
    id: u32,
    parent: Option<u32>,
    kind: SpanKind,
    name: String,
    t0_ms: u64,
    t1_ms: Option<u64>,
    status: String,
    tin: Option<u64>,
    tout: Option<u64>,
    args: Option<Json>,
    key: Option<String>,
    result_tokens: Option<u64>,
}

impl Record for Span {
    type Row = SpanRow;
    fn to_row(&self) -> SpanRow {
        SpanRow {
            id: self.id,
            parent: self.parent,
            kind: self.kind,
            name: self.name.to_string(),
            t0_ms: self.t0_ms,
            t1_ms: self.t1_ms,
            status: self.status.to_string(),
            tin: self.tin,
            tout: self.tout,
            args: self.args.as_ref().map(Json::of_map),
            key: self.key.clone(),
            result_tokens: self.result_tokens,
        }
    }
    fn from_row(r: SpanRow) -> R<Span> {
        Ok(Span {
            id: r.id,
            parent: r.parent,
            kind: r.kind,
            name: r.name.into(),
            t0_ms: r.t0_ms,
            t1_ms: r.t1_ms,
            status: r.status.into(),
            tin: r.tin,
            tout: r.tout,
            args: r.args.map(|j| j.map()).transpose()?,
            key: r.key,
            result_tokens: r.result_tokens,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub struct EventRow {
    seq: u64,
    at_ms: u64,
    task: Option<String>,
    verb: String,
    by: String,
    reason: Option<String>,
    detail: Json,
}

impl Record for Event {
    type Row = EventRow;
    fn to_row(&self) -> EventRow {
        EventRow {
            seq: self.seq,
            at_ms: self.at_ms,
            task: self.task.clone(),
            verb: self.verb.clone(),
            by: self.by.clone(),
            reason: self.reason.clone(),
            detail: Json::of(&self.detail),
        }
    }
    fn from_row(r: EventRow) -> R<Event> {
        Ok(Event {
            seq: r.seq,
            at_ms: r.at_ms,
            task: r.task,
            verb: r.verb,
            by: r.by,
            reason: r.reason,
            detail: r.detail.value()?,
        })
    }
}

#[derive(Serialize, Deserialize)]
pub struct NoteRow {
    user: String,
    text: String,
    source: String,
    created_at_s: u64,
    expires_at_s: u64,
}

impl Record for Note {
    type Row = NoteRow;
    fn to_row(&self) -> NoteRow {
        NoteRow {
            user: self.user.clone(),
            text: self.text.clone(),
            source: self.source.clone(),
            created_at_s: self.created_at_s,
            expires_at_s: self.expires_at_s,
        }
    }
    fn from_row(r: NoteRow) -> R<Note> {
        Ok(Note {
            user: r.user,
            text: r.text,
            source: r.source,
            created_at_s: r.created_at_s,
            expires_at_s: r.expires_at_s,
        })
    }
}
