//! What an operator does, as one library API that the CLI, the web console and the daemon all
//! call, so that an action taken in any of them writes the same audit event through the same
//! code.
//!
//! The decisions (approve, reject, reconcile, cancel, and the daemon's expiry of waits on a
//! person) are in `decide`, a person's answer to a task's question in `answer`, a follow-up
//! message that continues a finished task in `say`, each one function over a transaction of
//! the backend; what they carry (the reviewed call, a budget extension, a settlement) is in
//! `review`. This module
//! adds what sits around them: checking who decides and why ([`decision`]), the held writes
//! as an operator reviews them ([`held_writes`]), settling held writes from each tool's lookup
//! ([`reconcile_auto`]), a task's whole detail ([`detail`]), and the effects of a task in the
//! demo shop.

mod answer;
mod decide;
mod review;
mod say;
pub mod schedule;
pub mod stream;
pub mod submit;
mod wait;

pub use answer::answer;
pub use decide::{
    HeldWrites, approve, cancel, complete_requested_cancel, expire_approvals, held, reconcile,
    reject,
};
pub use review::{Extension, Reviewed, Settlement};
pub use say::{Said, say};
pub use wait::{Until, Waited, wait};

use serde::Serialize;
use serde_json::Value;
use std::sync::Arc;

use crate::kernel::Span;
use crate::limits;
use crate::model::RecordedReply;
#[cfg(test)]
use crate::store::NewTask;
use crate::store::prelude::*;
use crate::store::{CallRecord, Decision, Error, Event, QueueStatus, Result, TaskRecord};
use crate::tools::Effect;
use crate::tools::durable::{DurableStore, LedgerEntry};
use crate::tools::http::{Lookup, lookup};

/// A decision's who and why, checked: a name that is not empty and within the limits, a
/// reason within its limit. The time is now.
pub fn decision(by: &str, reason: Option<&str>) -> std::result::Result<Decision, String> {
    if by.trim().is_empty() {
        return Err("--by must not be empty: it names the operator in the audit log".into());
    }
    limits::check_text(by, "--by", limits::NAME_BYTES_MAX).map_err(|e| e.0)?;
    if let Some(r) = reason {
        limits::check_text(r, "--reason", limits::REASON_BYTES_MAX).map_err(|e| e.0)?;
    }
    Ok(Decision {
        by: by.to_string(),
        reason: reason.map(str::to_string),
        now_ms: crate::clock::now_ms(),
    })
}

/// A held write as an operator reviews it: the call, its key and digest, and what is known.
#[derive(Clone, Debug, Serialize)]
pub struct HeldWrite {
    pub task: String,
    pub status: QueueStatus,
    pub tool: String,
    pub args: Value,
    pub key: String,
    pub digest: String,
    /// When its intent was committed (or the task last changed, without a call record).
    pub since_ms: u64,
    /// The last answer recorded for the call, if any.
    pub known: Option<Value>,
    /// Why the call record cannot be read, if it cannot.
    pub call_record_error: Option<String>,
}

/// Every held write (unknown outcome, also of cancelled tasks), oldest first.
pub fn held_writes(db: &dyn Backend) -> Result<Vec<HeldWrite>> {
    let mut out = Vec::new();
    for (r, c) in held(db)? {
        let Some(p) = &r.state.pending else { continue };
        let record = c.as_ref().ok().and_then(Option::as_ref);
        out.push(HeldWrite {
            task: r.id.clone(),
            status: r.status,
            tool: p.name.clone(),
            args: Value::Object(p.args.clone()),
            key: db.call_key(&r, p),
            digest: p.digest(),
            since_ms: record.map_or(r.updated_at_ms, |c| c.intent_at_ms),
            known: record.and_then(|c| c.result.clone()),
            call_record_error: c.as_ref().err().cloned(),
        });
    }
    Ok(out)
}

/// What `reconcile --auto` did with one held write.
#[derive(Clone, Debug, Serialize)]
pub struct AutoSettled {
    pub task: String,
    pub tool: String,
    pub key: String,
    /// `applied`, `not_applied` or `left_held`.
    pub outcome: &'static str,
    /// Why it was left held.
    pub why: Option<String>,
}

/// Asks each held write's tool whether its key was applied (an HTTP tool's `lookup_url`, or
/// the demo shop, opened by `tools` when first needed) and settles only on a definite
/// answer; the key looked up is checked again in the transaction that settles it.
pub fn reconcile_auto(
    db: &dyn Backend,
    config: &crate::config::Config,
    tools: &mut dyn FnMut() -> Result<Arc<DurableStore>>,
    by: &str,
    reason: Option<&str>,
) -> std::result::Result<Vec<AutoSettled>, Error> {
    let reason = reason.unwrap_or("reconcile --auto: the tool's lookup answered");
    let d = decision(by, Some(reason)).map_err(Error::Invalid)?;
    settle_by_lookup(db, config, tools, &d, &mut |_, _, _, _| Some(true))
}

/// What picks the held writes to settle: given the task, its held call, the call's key and
/// its call record (when it can be read), `None` to leave it, or whether a lookup's "not
/// applied" may settle it (`Some(false)`: only "applied" does).
pub type Select<'a> = dyn FnMut(&TaskRecord, &crate::kernel::ToolCall, &str, Option<&CallRecord>) -> Option<bool>
    + 'a;

/// [`reconcile_auto`] for the held writes that `select` picks, decided as `d`: the daemon's
/// own settling uses it.
pub fn settle_by_lookup(
    db: &dyn Backend,
    config: &crate::config::Config,
    tools: &mut dyn FnMut() -> Result<Arc<DurableStore>>,
    d: &Decision,
    select: &mut Select<'_>,
) -> std::result::Result<Vec<AutoSettled>, Error> {
    let mut demo: Option<Arc<DurableStore>> = None;
    let mut out = Vec::new();
    for (rec, record) in held(db)? {
        let Some(call) = rec.state.pending.clone() else {
            continue;
        };
        let key = db.call_key(&rec, &call);
        let record = record.ok().flatten();
        let Some(trust_not_applied) = select(&rec, &call, &key, record.as_ref()) else {
            continue;
        };
        let answer = ask_tool(&rec, &call.name, &key, config, &mut || {
            if demo.is_none() {
                demo = Some(tools()?);
            }
            Ok(demo.clone().expect("just opened"))
        })?;
        let mut row = AutoSettled {
            task: rec.id.clone(),
            tool: call.name.clone(),
            key: key.clone(),
            outcome: "left_held",
            why: None,
        };
        let settlement = match answer {
            Lookup::Applied(result) => Settlement::Applied(result),
            Lookup::NotApplied if trust_not_applied => Settlement::NotApplied,
            Lookup::NotApplied => {
                row.why = Some("the lookup says not applied, but the write was sent too recently for that to be final (lookup_grace_ms)".into());
                out.push(row);
                continue;
            }
            Lookup::Unknown(why) => {
                row.why = Some(why);
                out.push(row);
                continue;
            }
        };
        let applied = matches!(settlement, Settlement::Applied(_));
        let reviewed = Reviewed {
            key: Some(key),
            digest: Some(call.digest()),
        };
        match reconcile(
            db,
            &rec.id,
            &settlement,
            &reviewed,
            &Extension::default(),
            d,
        ) {
            Ok(_) => row.outcome = if applied { "applied" } else { "not_applied" },
            Err(e) => row.why = Some(e.to_string()),
        }
        out.push(row);
    }
    Ok(out)
}

/// Asks the tool of a task's call whether `key` was applied: an HTTP tool's `lookup_url` from
/// `config`'s catalog (the operator's own; never a URL the task stored, whose answer would
/// settle the write), or the demo shop (opened by `tools`) for a task without a
/// catalog.
pub fn ask_tool(
    rec: &TaskRecord,
    tool: &str,
    key: &str,
    config: &crate::config::Config,
    tools: &mut dyn FnMut() -> Result<Arc<DurableStore>>,
) -> Result<Lookup> {
    let spec = rec.catalog.as_ref().map(|c| c.get(tool));
    Ok(match spec {
        // The task sent it elsewhere than to an HTTP tool of that name.
        Some(Some(s)) if matches!(s.route(), crate::kernel::Route::Mcp(_)) => Lookup::Unknown(
            format!("tool {tool} is an MCP tool of this task: MCP has no lookup to ask"),
        ),
        Some(Some(s)) if matches!(s.route(), crate::kernel::Route::Demo) => {
            match tools()?.lookup(key, tool) {
                Ok(Some(result)) => Lookup::Applied(result),
                Ok(None) => Lookup::NotApplied,
                Err(e) => Lookup::Unknown(e.to_string()),
            }
        }
        Some(Some(_)) => match config.lookup_url(tool) {
            Some(url) => lookup(
                url,
                key,
                config.lookup_timeout(tool),
                &config.lookup_auth(tool),
            ),
            None if config.catalog.is_none() => Lookup::Unknown(format!(
                "no tool catalog to find tool {tool}'s lookup_url in: pass --config with the catalog the task runs with"
            )),
            None => Lookup::Unknown(format!(
                "tool {tool} has no lookup_url in the config's catalog"
            )),
        },
        Some(None) => Lookup::Unknown(format!("tool {tool} is not in the task's catalog")),
        None => match tools()?.lookup(key, tool) {
            Ok(Some(result)) => Lookup::Applied(result),
            Ok(None) => Lookup::NotApplied,
            Err(e) => Lookup::Unknown(e.to_string()),
        },
    })
}

/// How the tool's lookup says task `id`'s held write ended, as a settlement: its tool's
/// `lookup_url` in `config`'s catalog, or the demo shop (at `tools_target`) for a demo task.
/// `Err` when the task holds no such write or the lookup gives no definite answer.
pub fn settlement_by_lookup(
    db: &dyn Backend,
    id: &str,
    config: &crate::config::Config,
    tools_target: &str,
) -> Result<Settlement> {
    let rec = db.task(id)?;
    let Some(call) = rec.state.unknown_write().cloned() else {
        return Err(Error::Invalid(format!(
            "task {id} holds no write whose outcome is unknown"
        )));
    };
    let key = db.call_key(&rec, &call);
    let mut open = || Ok(Arc::new(DurableStore::open_target(tools_target)?));
    match ask_tool(&rec, &call.name, &key, config, &mut open)? {
        Lookup::Applied(v) => Ok(Settlement::Applied(v)),
        Lookup::NotApplied => Ok(Settlement::NotApplied),
        Lookup::Unknown(why) => Err(Error::Invalid(format!(
            "the tool's lookup gave no definite answer for key {key} ({why})"
        ))),
    }
}

/// Everything about one task: its record, trace, recorded replies, call records and audit
/// events, as `worker show` and the console's task page present them.
pub struct TaskDetail {
    pub record: TaskRecord,
    pub spans: Vec<Span>,
    pub replies: Vec<RecordedReply>,
    pub calls: Vec<CallRecord>,
    pub events: Vec<Event>,
    /// The held call's key, when a call is held or pending.
    pub pending_key: Option<String>,
}

pub fn detail(db: &dyn Backend, id: &str) -> Result<TaskDetail> {
    let record = db.task(id)?;
    let pending_key = record
        .state
        .pending
        .as_ref()
        .map(|p| db.call_key(&record, p));
    Ok(TaskDetail {
        spans: db.spans(id)?,
        replies: db.replies(id)?,
        calls: db.calls(id)?,
        events: db.events(Some(id))?,
        pending_key,
        record,
    })
}

/// The effects of task `rec` of the database whose id is `db_id` (its keys are
/// `NS:task:step`, in the task's namespace, and `NS:task#N:step` in turn N of a conversation).
pub fn task_effects(ledger: &[LedgerEntry], db_id: &str, rec: &TaskRecord) -> Vec<Effect> {
    let first = format!("{}:{}:", rec.key_namespace(db_id), rec.id);
    let later = format!("{}:{}#", rec.key_namespace(db_id), rec.id);
    ledger
        .iter()
        .filter(|e| e.key.starts_with(&first) || e.key.starts_with(&later))
        .map(|e| e.effect.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review 48: a held write the task sent to an MCP server was looked up at the
    /// `lookup_url` of the config's HTTP tool of the same name. The task's own catalog says
    /// where its write went: an MCP write has no lookup, and none is asked.
    #[test]
    fn a_lookup_asks_only_the_route_the_task_sent_its_write_to() {
        let http = crate::config::parse_catalog(
            "version = 1\n[[tools]]\nname = \"add_note\"\naccess = \"write\"\n\
             http = { url = \"http://127.0.0.1:9/notes\", lookup_url = \"http://127.0.0.1:9/lookup\" }\n",
            std::path::Path::new("tools.toml"),
        )
        .expect("a catalog");
        let config = crate::config::Config {
            catalog: Some(http.clone()),
            ..Default::default()
        };
        let mut mcp = http;
        for t in &mut mcp.tools {
            t.http = None;
            t.mcp = Some(crate::kernel::catalog::McpSpec {
                server: "shop".into(),
                digest: "d".into(),
                input_schema: serde_json::json!({"type": "object"}),
                needs_approval: false,
                user_arg: None,
            });
        }
        let t = NewTask {
            catalog: Some(mcp),
            ..crate::testing::task()
        };
        let rec = crate::store::new_record("db", "t1", &t, &[], 0);
        let mut no_shop = || Err(Error::Invalid("no demo shop here".into()));
        match ask_tool(&rec, "add_note", "db:t1:s1", &config, &mut no_shop) {
            Ok(Lookup::Unknown(why)) => assert!(why.contains("MCP"), "{why}"),
            other => panic!("an MCP write was looked up: {other:?}"),
        }
    }
}
