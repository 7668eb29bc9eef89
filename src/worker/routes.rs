//! A task's tool calls as the durable driver makes them: routed to where the catalog says each
//! tool lives, every answer counted and logged.

use serde_json::json;

use crate::kernel::Route;
use crate::kernel::{Access, Catalog, ToolReply};
use crate::mcp::McpTools;
use crate::tools::Tools;
use crate::tools::durable::{DemoShop, DurableTools};
use crate::tools::http::HttpTools;

/// Counts a tool call by its result's status and logs one that did not succeed, with the task
/// and call key.
pub(super) fn observe_tool(task: &str, key: &str, tool: &str, reply: &ToolReply) {
    let m = crate::metrics::global();
    let status = reply.result["status"].as_str().unwrap_or("invalid");
    m.tool_calls.with_label_values(&[tool, status]).inc();
    m.tool_seconds
        .with_label_values(&[tool])
        .observe(reply.latency_ms as f64 / 1000.0);
    let code = reply.result["code"].as_str().unwrap_or("");
    let detail = reply.result["detail"].as_str().unwrap_or("");
    match status {
        "ok" => tracing::debug!(task, key, tool, "tool call ok"),
        // The outcome of a write is not known: it will be held for reconcile.
        "unknown" => tracing::warn!(task, key, tool, code, detail, "tool call outcome unknown"),
        "needs_approval" => tracing::info!(task, key, tool, "tool call needs approval"),
        _ => tracing::warn!(task, key, tool, status, code, detail, "tool call failed"),
    }
}

/// A task's tools, each call sent where its catalog entry says the tool lives (its
/// [`Route`]): an MCP server, an HTTP URL, or the demo shop, which is opened only when a call
/// goes there; a tool the daemon's config lacks, nowhere.
pub(super) struct Routed<'a> {
    pub catalog: &'a Catalog,
    pub unavailable: &'a std::collections::BTreeMap<String, String>,
    pub demo: DemoRoute<'a>,
    pub http: HttpTools<'a>,
    pub mcp: McpTools<'a>,
}

/// The demo shop as one task's route: the daemon's shop (if it has one), in the task's scope
/// with its latency overrides.
pub(super) struct DemoRoute<'a> {
    pub shop: Option<&'a DemoShop>,
    pub scope: &'a str,
    pub latency_ms: &'a std::collections::BTreeMap<String, u64>,
}

impl DemoRoute<'_> {
    /// Whether a read may run in place: the shop is open, on a local file.
    fn in_place(&self) -> bool {
        self.shop.is_some_and(DemoShop::is_open_locally)
    }
}

impl Tools for DemoRoute<'_> {
    fn call(&mut self, req: &crate::kernel::ToolRequest<'_>) -> ToolReply {
        let opened = match self.shop {
            Some(shop) => shop.get(),
            None => Err("this daemon has no demo shop".to_string()),
        };
        let store = match opened {
            Ok(store) => store,
            // Nothing was sent: the call may be made again.
            Err(why) => return not_sent("tool_unavailable", why),
        };
        // The shop is in this process: its first byte is the call itself.
        if let Err(why) = req.ready_to_send() {
            return not_sent("not_sent", why);
        }
        DurableTools {
            store: &store,
            scope: self.scope,
            latency_ms: self.latency_ms,
        }
        .call(req)
    }
}

/// The answer to a call that was not sent.
fn not_sent(code: &str, why: String) -> ToolReply {
    ToolReply {
        result: json!({"status": "error", "code": code, "detail": why}),
        latency_ms: 0,
    }
}

impl Routed<'_> {
    /// Sends `req` where its tool lives: over HTTP without holding a thread; to an MCP server or
    /// the demo shop, whose clients block, off the executor's threads ([`super::blocking`]).
    pub async fn call(&mut self, req: &crate::kernel::ToolRequest<'_>) -> ToolReply {
        if let Some(why) = self.unavailable.get(&req.call.name) {
            return ToolReply {
                result: json!({"status": "error", "code": "tool_unavailable", "detail": why}),
                latency_ms: 0,
            };
        }
        // (Approval rules are the durable step's machine's, applied before a call gets here.)
        match self.catalog.get(&req.call.name) {
            Some(spec) => match spec.route() {
                Route::Mcp(_) => super::blocking(|| self.mcp.call(req)),
                Route::Http(_) => self.http.call(req).await,
                // A read of a shop in a local file takes microseconds: in place, as the
                // database's own reads are; a write (it syncs the file) or a read of a shop on a
                // database server, off the executor's threads.
                Route::Demo if req.access == Access::Read && self.demo.in_place() => {
                    self.demo.call(req)
                }
                Route::Demo => super::blocking(|| self.demo.call(req)),
                // The kernel holds a question for a person; it never asks a route to send one.
                Route::Person => ToolReply {
                    result: json!({"status": "error", "code": "not_sent",
                        "detail": "a question to a person is answered by a person, never sent"}),
                    latency_ms: 0,
                },
            },
            None => ToolReply {
                result: json!({"status": "error", "code": "unknown_tool",
                    "detail": format!("{} is not in this task's catalog", req.call.name)}),
                latency_ms: 0,
            },
        }
    }
}
