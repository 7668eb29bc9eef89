//! Sessions with MCP servers over the official Rust SDK (`rmcp`). Its async runtime is
//! confined here: one small tokio runtime owned by [`Mcp`], entered by `block_on` from the
//! worker's threads, so the rest of the daemon stays thread-per-task. One session per server,
//! started when first needed and started again after it died; every request is bounded by a
//! timeout, and a request abandoned at its timeout is cancelled (`notifications/cancelled`:
//! the SDK sends it when the request's future is dropped).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use rmcp::model::Tool;
use rmcp::service::RunningService;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};

use super::config::{McpConfig, ServerConfig};

type Session = RunningService<RoleClient, ()>;

/// The MCP servers of a config, and a session with each that was needed.
pub struct Mcp {
    config: McpConfig,
    rt: tokio::runtime::Runtime,
    sessions: Mutex<BTreeMap<String, std::sync::Arc<Session>>>,
}

impl Mcp {
    pub fn new(config: McpConfig) -> Result<Mcp, String> {
        for (name, s) in &config.servers {
            s.check(name)?;
        }
        // reqwest is built without a TLS provider of its own: use ring, as ureq does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mcp")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the MCP runtime: {e}"))?;
        Ok(Mcp {
            config,
            rt,
            sessions: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn servers(&self) -> impl Iterator<Item = (&String, &ServerConfig)> {
        self.config.servers.iter()
    }

    async fn connect(name: &str, s: &ServerConfig) -> Result<Session, String> {
        if let Some(cmd) = &s.command {
            let mut c = tokio::process::Command::new(cmd);
            // The child gets exactly the environment the config names: never the worker's
            // own (API keys included) unless a variable is listed in env_from.
            c.args(&s.args).env_clear().envs(s.child_env());
            let (transport, _stderr) = TokioChildProcess::builder(c)
                .stderr(std::process::Stdio::null())
                .spawn()
                .map_err(|e| format!("MCP server {name}: cannot start {cmd:?}: {e}"))?;
            return ()
                .serve(transport)
                .await
                .map_err(|e| format!("MCP server {name}: the session did not start: {e}"));
        }
        let url = s.url.clone().unwrap_or_default();
        let mut headers = std::collections::HashMap::new();
        for (header, var) in &s.headers_from_env {
            let value = std::env::var(var).map_err(|_| {
                format!("MCP server {name}: header {header} needs the environment variable {var}, which is not set")
            })?;
            let n = http::HeaderName::try_from(header.as_str())
                .map_err(|e| format!("MCP server {name}: header {header:?}: {e}"))?;
            let v = http::HeaderValue::try_from(value)
                .map_err(|e| format!("MCP server {name}: the value of {var}: {e}"))?;
            headers.insert(n, v);
        }
        let config =
            rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                url,
            )
            .custom_headers(headers);
        let transport = StreamableHttpClientTransport::from_config(config);
        ().serve(transport)
            .await
            .map_err(|e| format!("MCP server {name}: the session did not start: {e}"))
    }

    /// The session with `server`, started if there is none or the last one has closed.
    fn session(&self, server: &str, timeout: Duration) -> Result<std::sync::Arc<Session>, String> {
        let s = self
            .config
            .servers
            .get(server)
            .ok_or_else(|| format!("no MCP server named {server} in the config"))?;
        let mut sessions = self
            .sessions
            .lock()
            .map_err(|_| "the MCP sessions lock is poisoned".to_string())?;
        if let Some(existing) = sessions.get(server) {
            if !existing.is_closed() {
                return Ok(std::sync::Arc::clone(existing));
            }
            tracing::warn!(server, "MCP session closed; starting a new one");
        }
        let session = self
            .rt
            .block_on(async { tokio::time::timeout(timeout, Self::connect(server, s)).await })
            .map_err(|_| {
                format!(
                    "MCP server {server}: no session within {} ms",
                    timeout.as_millis()
                )
            })??;
        let session = std::sync::Arc::new(session);
        sessions.insert(server.to_string(), std::sync::Arc::clone(&session));
        Ok(session)
    }

    /// The tools `server` offers (`tools/list`, every page).
    pub fn list_tools(&self, server: &str, timeout: Duration) -> Result<Vec<Tool>, String> {
        let session = self.session(server, timeout)?;
        self.rt
            .block_on(async { tokio::time::timeout(timeout, session.list_all_tools()).await })
            .map_err(|_| {
                format!(
                    "MCP server {server}: tools/list gave no answer within {} ms",
                    timeout.as_millis()
                )
            })?
            .map_err(|e| format!("MCP server {server}: tools/list failed: {e}"))
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.clear();
        }
    }
}
