//! Calls from tasks to MCP tools: the worker's side of every guarantee MCP itself does not
//! give. Before anything is sent, a tool that needs approval must run under an operator's
//! approval of this call's key and digest, and the server's definition must still be the one
//! the task was enqueued with. The task's user id goes into the tool's `user_arg`. A call is
//! bounded by the task's remaining active time. `tools/call` has no idempotency key, so a lost
//! answer (a timeout, a dropped connection, a crashed server) or one that cannot be used (over
//! the limits, a JSON-RPC error that is not a refusal) is re-sent only for a tool that is
//! idempotent; for any other write it is an `unknown` outcome, which the kernel holds for
//! `worker reconcile`. (A write already answered under its call key is never sent again: the
//! driver answers a repeat from the call record, being the idempotency layer MCP lacks.)

use serde_json::{Value, json};
use std::time::{Duration, Instant};

use super::catalog::definition_digest;
use super::client::{CallOutcome, Mcp};
use crate::kernel::catalog::{Access, args_as_sent};
use crate::kernel::{Catalog, ToolReply, ToolRequest};
use crate::tools::Tools;

/// How many times an idempotent tool is sent before its answer counts as lost.
pub const IDEMPOTENT_ATTEMPTS: u32 = 3;

/// The MCP tools of one task's catalog, called through the daemon's sessions.
pub struct McpTools<'a> {
    /// `None` when this worker was started without MCP servers in its config.
    pub mcp: Option<&'a Mcp>,
    pub catalog: &'a Catalog,
}

impl Tools for McpTools<'_> {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        let start = Instant::now();
        let result = self.result(req, start);
        ToolReply {
            result,
            latency_ms: start.elapsed().as_millis() as u64,
        }
    }
}

fn refused(code: &str, detail: String) -> Value {
    json!({"status": "error", "code": code, "detail": detail})
}

impl McpTools<'_> {
    fn result(&self, req: &ToolRequest<'_>, start: Instant) -> Value {
        let name = req.call.name.as_str();
        let Some((spec, m)) = self
            .catalog
            .get(name)
            .and_then(|s| s.mcp.as_ref().map(|m| (s, m)))
        else {
            return refused(
                "unknown_tool",
                format!("{name} is not an MCP tool of this task"),
            );
        };
        let Some(mcp) = self.mcp else {
            return refused(
                "mcp_unavailable",
                format!(
                    "this worker has no MCP server {}: start it with --config naming the server",
                    m.server
                ),
            );
        };
        if m.needs_approval && req.approval.is_none() {
            // The worker's machine holds such a call before it gets here; a caller without one
            // is refused all the same: nothing goes out until an operator approves this call.
            return json!({"status": "needs_approval", "code": crate::kernel::io::HELD_BY_RULE});
        }
        let deadline = start + Duration::from_millis(req.timeout_ms.max(1));
        let left = || deadline.saturating_duration_since(Instant::now());
        if let Err(refusal) = check_definition(mcp, spec, m, name, left()) {
            return refusal;
        }
        let args = args_as_sent(spec, &req.call.args, req.user_id);
        let attempts = if req.idempotent {
            IDEMPOTENT_ATTEMPTS
        } else {
            1
        };
        let mut lost = ("lost", String::from("no time was left for the call"));
        for attempt in 1..=attempts {
            let time = left();
            if time.is_zero() {
                break;
            }
            // The write's proof of its claim comes last, after the definition check and the
            // session, and over HTTP after the connection (each attempt asks again).
            let ready = req.gate.map(|g| {
                let g = std::sync::Arc::clone(g);
                std::sync::Arc::new(move || g.ready()) as crate::net::Ready
            });
            lost = match mcp.call_gated(&m.server, name, args.clone(), time, ready) {
                CallOutcome::Answered(v) => return v,
                CallOutcome::NotSent(why) => return refused("not_sent", why),
                CallOutcome::Lost(why) => ("lost", why),
                CallOutcome::Unusable(why) => ("unusable_answer", why),
            };
            if attempt < attempts {
                tracing::warn!(server = %m.server, tool = name, key = req.key, attempt, error = %lost.1, "MCP answer lost or unusable; re-sending (the tool is idempotent)");
            }
        }
        let (code, detail) = lost;
        if req.access == Access::Write {
            // It may have been applied: the kernel holds it (non-idempotent) for reconcile.
            json!({"status": "unknown", "code": code, "detail": detail})
        } else {
            json!({"status": "error", "code": code, "detail": detail})
        }
    }
}

/// Refused unless MCP server `m.server` still offers `name` with the definition the task was
/// enqueued with, and this worker's config reads that definition as the task's snapshot.
fn check_definition(
    mcp: &Mcp,
    spec: &crate::kernel::ToolSpec,
    m: &crate::kernel::catalog::McpSpec,
    name: &str,
    time: Duration,
) -> Result<(), Value> {
    match mcp.definition(&m.server, name, time) {
        Ok(Some(now)) => {
            let digest = definition_digest(&now);
            // The task's snapshot must be what this worker's own config makes of the
            // definition: its kinds (read, idempotent, approval), facts and user argument
            // come from the daemon's trust in the server, never from whoever enqueued.
            let here = mcp
                .server_config(&m.server)
                .map(|cfg| super::resolve(&m.server, cfg, &now).to_spec());
            if digest == m.digest && here.as_ref() != Some(spec) {
                tracing::warn!(server = %m.server, tool = name, "MCP tool snapshot differs from this worker's reading of it; call refused");
                return Err(refused(
                    "tool_mismatch",
                    format!(
                        "the task's snapshot of {name} (from its enqueue) is not what this worker's config makes of MCP server {}'s definition (kind, approval, facts or user argument differ); nothing was sent",
                        m.server
                    ),
                ));
            }
            if digest != m.digest {
                tracing::warn!(server = %m.server, tool = name, enqueued = %m.digest, now = %digest, "MCP tool changed since enqueue; call refused");
                return Err(refused(
                    "tool_changed",
                    format!(
                        "the definition of {name} on MCP server {} changed since the task was enqueued (digest {} then, {digest} now); nothing was sent",
                        m.server, m.digest
                    ),
                ));
            }
            Ok(())
        }
        Ok(None) => Err(refused(
            "tool_changed",
            format!(
                "MCP server {} no longer offers {name}; nothing was sent",
                m.server
            ),
        )),
        // Nothing was sent: the session or its tools/list failed.
        Err(e) => Err(refused("unavailable", e)),
    }
}
