//! Tools from MCP servers. `config` declares the servers (child processes or streamable HTTP,
//! trusted or not, per-tool overrides); `client` keeps one session per server on the SDK's
//! runtime, confined here; `catalog` turns a server's tool definitions into the kernel's tool
//! kinds (read, idempotent write, write, approval) and digests them.
//!
//! Discovery, `worker tools list` and calls (`Mcp::call`: answered, or lost at a timeout, a
//! crash or a dropped answer) work today; calls from tasks (the snapshot at enqueue, argument
//! checks against the input schema, held writes after a lost answer) are the rest of issue 12.

pub mod catalog;
pub mod client;
pub mod config;

pub use catalog::{McpTool, resolve};
pub use client::{CallOutcome, Mcp};
pub use config::{McpConfig, ServerConfig};

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
