//! A tool call in the durable step: a write's call record read, its intent committed, the
//! approval rules applied, the call sent and its answer folded in. Reads are sent at once.

use serde_json::{Value, json};

use super::{Damaged, Machine, Need, Phase, commit::After};
use crate::kernel::{Access, Route, ToolCall, ToolReply, ToolRequest};
use crate::model::RecordedTool;
use crate::store::{CallRecord, CommitKind};

/// A tool request copied out of the session, so the session can be committed before the
/// call is sent; its digest made once.
pub(super) struct Pending {
    call: ToolCall,
    key: String,
    user_id: String,
    timeout_ms: u64,
    access: Access,
    idempotent: bool,
    held: bool,
    digest: String,
}

impl Pending {
    pub(super) fn of(r: &ToolRequest<'_>) -> Pending {
        Pending {
            call: r.call.clone(),
            key: r.key.to_string(),
            user_id: r.user_id.to_string(),
            timeout_ms: r.timeout_ms,
            access: r.access,
            idempotent: r.idempotent,
            held: r.held,
            digest: r.call.digest(),
        }
    }
}

/// Where a tool call stands.
pub(super) enum Call {
    /// A write's call record is read (`on_call`).
    Record(Pending),
    /// The call goes out (`on_sent`), with the approval it carries.
    Sending(Pending, Option<String>),
}

/// A call to send: the request as a route takes it, and whether it needs the proof of the
/// claim (a write: the driver proves the claim as the last step before its first byte, and
/// sends nothing if it cannot).
pub struct Send<'a> {
    pub request: ToolRequest<'a>,
    pub proof: bool,
}

impl<'c> Machine<'c> {
    /// A tool call the session asks for. Returns whether the run moved on by itself.
    pub(super) fn on_tool(&mut self, p: Pending, now_ms: u64) -> bool {
        if p.access == Access::Write {
            self.phase = Phase::Tool(Call::Record(p));
            return false;
        }
        self.send_or_hold(p, now_ms)
    }

    pub(super) fn tool_need(&self) -> Need<'_> {
        match &self.phase {
            Phase::Tool(Call::Record(p)) => Need::Call { key: &p.key },
            Phase::Tool(Call::Sending(p, approval)) => Need::Send(Send {
                request: ToolRequest {
                    call: &p.call,
                    key: &p.key,
                    user_id: &p.user_id,
                    timeout_ms: p.timeout_ms,
                    access: p.access,
                    idempotent: p.idempotent,
                    held: p.held,
                    approval: approval.as_deref(),
                    gate: None,
                },
                proof: p.access == Access::Write,
            }),
            _ => super::unexpected("a tool phase without its call"),
        }
    }

    /// The call record of the write in progress (`Err`: it exists and cannot be read): the
    /// write is answered from it, held, or has its intent committed.
    pub fn on_call(&mut self, record: Result<Option<CallRecord>, Damaged>, now_ms: u64) {
        let Phase::Tool(Call::Record(_)) = &self.phase else {
            return super::unexpected_answer("a call record");
        };
        let Phase::Tool(Call::Record(p)) = std::mem::replace(&mut self.phase, Phase::Session)
        else {
            return;
        };
        let (existing, damaged) = match record {
            Ok(c) => (c, false),
            Err(Damaged(why)) => {
                // A record that cannot be decoded says nothing about what was sent: the call
                // is held, never sent blind.
                tracing::error!(task = %self.rec.id, key = %p.key, error = %why, "call record damaged; holding the call");
                (None, true)
            }
        };
        let in_flight = existing.as_ref().is_some_and(|c| c.result.is_none());
        // A route without an idempotency key of its own (MCP): this worker is the idempotency
        // layer. A write already applied under this key is answered from its call record.
        let keyless = self
            .catalog
            .get(&p.call.name)
            .is_some_and(|s| matches!(s.route(), Route::Mcp(_)));
        if let Some(answer) = existing
            .as_ref()
            .filter(|_| keyless)
            .and_then(|c| answered_from_record(c, &p.digest))
        {
            tracing::info!(task = %self.rec.id, key = %p.key, tool = %p.call.name, "write already applied under this key; answered from its call record, not sent");
            return self.answer(
                &p,
                ToolReply {
                    result: answer,
                    latency_ms: 0,
                },
                now_ms,
            );
        }
        if damaged || (in_flight && !p.idempotent) {
            // Sent before a crash (a fresh call or a resumed held one), outcome never learned,
            // and not safe to re-send: held for reconcile.
            self.step_call = existing;
            let unknown = json!({"status": "unknown", "code": "interrupted",
                "detail": "the worker stopped while this write was in flight; reconcile it"});
            return self.answer(
                &p,
                ToolReply {
                    result: unknown,
                    latency_ms: 0,
                },
                now_ms,
            );
        }
        let call = CallRecord {
            key: p.key.clone(),
            task_id: self.rec.id.clone(),
            step: self.state().step,
            tool: p.call.name.clone(),
            args: p.call.args.clone(),
            digest: p.digest.clone(),
            intent_at_ms: now_ms,
            result: None,
            result_at_ms: None,
        };
        self.step_call = Some(call.clone());
        let reply = self.step_reply.clone();
        let commit = self.step_commit(CommitKind::Intent, reply, Some(call), None);
        self.commit(commit, After::Intent(p));
    }

    /// The write's intent is committed: it goes on to be sent (or held by its rule).
    pub(super) fn after_intent(&mut self, p: Pending, now_ms: u64) {
        self.send_or_hold(p, now_ms);
    }

    /// A call's approval rule (the catalog's, or an MCP tool's), applied before anything is
    /// sent, on every route: a call it covers goes out only under an operator's approval of
    /// exactly this call; until then it is held. Returns whether the run moved on by itself.
    fn send_or_hold(&mut self, p: Pending, now_ms: u64) -> bool {
        let approval = self
            .rec
            .approval
            .as_ref()
            .filter(|_| p.held)
            .and_then(|a| a.covering(&p.key, &p.digest))
            .map(str::to_string);
        let rule = self.catalog.get(&p.call.name).filter(|spec| {
            spec.approval.needs(&p.call.args) || spec.mcp.as_ref().is_some_and(|m| m.needs_approval)
        });
        if let (Some(spec), None) = (rule, &approval) {
            let why = match &spec.mcp {
                Some(m) if m.needs_approval => format!(
                    "MCP server {}'s tool {} needs an operator's approval (its config, or its annotations); the call is held until an operator approves it",
                    m.server, spec.name
                ),
                _ => format!(
                    "the catalog's approval rule for {} ({}) holds this call until an operator approves it",
                    spec.name,
                    Value::from(spec.approval.clone())
                ),
            };
            let held = json!({"status": "needs_approval", "code": crate::kernel::io::HELD_BY_RULE,
                "detail": why});
            self.answer(
                &p,
                ToolReply {
                    result: held,
                    latency_ms: 0,
                },
                now_ms,
            );
            return true;
        }
        self.phase = Phase::Tool(Call::Sending(p, approval));
        false
    }

    /// The sent call's answer.
    pub fn on_sent(&mut self, reply: ToolReply, now_ms: u64) {
        let Phase::Tool(Call::Sending(..)) = &self.phase else {
            return super::unexpected_answer("a tool's answer");
        };
        if let Phase::Tool(Call::Sending(p, _)) = std::mem::replace(&mut self.phase, Phase::Session)
        {
            self.answer(&p, reply, now_ms);
        }
    }

    /// Feeds a tool's answer to the session, adds it to the step's recorded reply (unless that
    /// reply was recorded before tool answers were kept), so a replay sees what this run saw,
    /// and records it as the write's result.
    fn answer(&mut self, p: &Pending, reply: ToolReply, now_ms: u64) {
        if let Some(tools) = self.step_reply.as_mut().and_then(|r| r.tools.as_mut()) {
            tools.push(RecordedTool {
                name: p.call.name.clone(),
                digest: p.digest.clone(),
                result: reply.result.clone(),
                latency_ms: reply.latency_ms,
            });
        }
        let Some(session) = self.session.as_mut() else {
            return;
        };
        session.on_tool(reply);
        if let Some(c) = self.step_call.as_mut()
            && c.key == p.key
        {
            c.result = session.state().last_result.clone();
            c.result_at_ms = Some(now_ms);
        }
        self.phase = Phase::Session;
    }
}

/// The answer to a repeat of the write recorded in `c`, if the tool answered it: applied
/// (`ok`), or failed by the tool's own account (`tool_error`: it ran, and may have had its
/// effect before it failed). Its recorded result (marked replayed) for the same arguments, a
/// `key_conflict` for others. A call refused before it reached the tool (no session, a
/// changed definition, a trusted server's refusal) may be sent again.
pub fn answered_from_record(c: &CallRecord, digest: &str) -> Option<Value> {
    let result = c.result.as_ref()?;
    if result["status"] != "ok" && result["code"] != "tool_error" {
        return None;
    }
    Some(if c.digest == digest {
        let mut r = result.clone();
        if let Some(m) = r.as_object_mut() {
            m.insert("replayed".into(), Value::Bool(true));
        }
        r
    } else {
        json!({"status": "error", "code": "key_conflict",
            "detail": format!("this plan step's write was already sent (digest {}) with other arguments and answered; nothing was sent again", c.digest)})
    })
}
