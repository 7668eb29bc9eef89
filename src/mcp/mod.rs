//! Tools from MCP servers. `config` declares the servers (child processes or streamable HTTP,
//! trusted or not, per-tool overrides); `client` keeps one session per server on the SDK's
//! runtime, confined here; `catalog` turns a server's tool definitions into the kernel's tool
//! kinds (read, idempotent write, write, approval), digests them, and makes the snapshot a
//! task keeps from enqueue; `tools` calls them from tasks (approval and definition checked
//! before sending, a lost answer re-sent only when idempotent, else held).

pub mod catalog;
pub mod client;
pub mod config;
mod gated;
pub mod tools;

pub use catalog::{McpTool, resolve, task_catalog};
pub use client::{CallOutcome, Mcp};
pub use config::{McpConfig, ServerConfig};
pub use tools::McpTools;

/// Every tool of every server of `mcp`, resolved; a server that cannot be reached is an error
/// naming it.
pub fn discover(mcp: &Mcp, timeout: std::time::Duration) -> Result<Vec<McpTool>, String> {
    let mut out = Vec::new();
    for (name, cfg) in mcp.servers() {
        for t in mcp.list_tools(name, timeout)? {
            out.push(resolve(name, cfg, &t));
        }
    }
    Ok(out)
}
