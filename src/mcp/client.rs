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
    /// The send gates of the calls in flight over HTTP (see `gated`).
    gates: super::gated::Gates,
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
            gates: super::gated::Gates::default(),
        })
    }

    pub fn servers(&self) -> impl Iterator<Item = (&String, &ServerConfig)> {
        self.config.servers.iter()
    }

    /// How this process's config declares the server `name`.
    pub fn server_config(&self, name: &str) -> Option<&ServerConfig> {
        self.config.servers.get(name)
    }

    async fn connect(
        name: &str,
        s: &ServerConfig,
        gates: super::gated::Gates,
    ) -> Result<Session, String> {
        if let Some(cmd) = &s.command {
            let mut c = tokio::process::Command::new(cmd);
            // The child gets exactly the environment the config names: never the worker's
            // own (API keys included) unless a variable is listed in env_from.
            c.args(&s.args).env_clear().envs(s.child_env());
            // A server that never exits on its own (one stuck in a call) dies with its session.
            c.kill_on_drop(true);
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
        let client = super::gated::GatedClient::new(gates)?;
        let transport = StreamableHttpClientTransport::with_client(client, config);
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
            .block_on(async {
                tokio::time::timeout(timeout, Self::connect(server, s, self.gates.clone())).await
            })
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

    /// The tools `server` offers (`tools/list`, every page), bounded: at most
    /// [`LIST_PAGES_MAX`] pages and [`LIST_TOOLS_MAX`] tools, so a server that answers every
    /// page with another `nextCursor` is an error, not a list that grows until memory runs out.
    pub fn list_tools(&self, server: &str, timeout: Duration) -> Result<Vec<Tool>, String> {
        let session = self.session(server, timeout)?;
        let pages = async {
            let mut tools = Vec::new();
            let mut cursor: Option<String> = None;
            for _ in 0..LIST_PAGES_MAX {
                let params = cursor
                    .take()
                    .map(|c| rmcp::model::PaginatedRequestParams::default().with_cursor(Some(c)));
                let page = session
                    .list_tools(params)
                    .await
                    .map_err(|e| format!("MCP server {server}: tools/list failed: {e}"))?;
                tools.extend(page.tools);
                if tools.len() > LIST_TOOLS_MAX {
                    return Err(format!(
                        "MCP server {server} lists more than {LIST_TOOLS_MAX} tools; this worker takes at most that many from one server"
                    ));
                }
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => return Ok(tools),
                }
            }
            Err(format!(
                "MCP server {server} answered {LIST_PAGES_MAX} pages of tools/list and still named another; this worker reads at most that many"
            ))
        };
        self.rt
            .block_on(async { tokio::time::timeout(timeout, pages).await })
            .map_err(|_| {
                format!(
                    "MCP server {server}: tools/list gave no answer within {} ms",
                    timeout.as_millis()
                )
            })?
    }
}

/// The most pages of `tools/list` read from one server.
pub const LIST_PAGES_MAX: usize = 64;
/// The most tools taken from one server.
pub const LIST_TOOLS_MAX: usize = 1024;

impl Mcp {
    /// The definition of `tool` as `server` offers it now (`tools/list`, which the SDK caches
    /// for as long as the server allows and drops when the server says its tools changed).
    pub fn definition(
        &self,
        server: &str,
        tool: &str,
        timeout: Duration,
    ) -> Result<Option<Tool>, String> {
        Ok(self
            .list_tools(server, timeout)?
            .into_iter()
            .find(|t| t.name == tool))
    }
}

/// What a `tools/call` came to.
#[derive(Clone, Debug, PartialEq)]
pub enum CallOutcome {
    /// The server answered: the result as the kernel takes a tool result (an object with a
    /// string `status`): `structuredContent` when present, the text content otherwise, and
    /// `isError` an error result (`tool_error`: the tool ran and says it failed). Also a
    /// JSON-RPC error from a trusted server that says the request was refused before the tool
    /// ran (parse error, invalid request, unknown method or tool, invalid parameters).
    Answered(serde_json::Value),
    /// No answer: timed out (the request was cancelled), or the session or server died. The
    /// call may or may not have taken effect.
    Lost(String),
    /// An answer arrived but says nothing usable of what the tool did: a result over the
    /// input limits, or a JSON-RPC error other than a trusted server's refusal (an internal
    /// error, a server-defined one), which a server may send after the tool had its effect.
    /// For a write this is an unknown outcome, as a lost answer is.
    Unusable(String),
    /// Not sent: the caller's gate refused it right before the request would have left.
    NotSent(String),
}

/// JSON-RPC error codes that mean the request was refused before any tool ran.
const REFUSALS: [i32; 4] = [-32700, -32600, -32601, -32602];

/// A `tools/call` result as a tool result for the kernel, bounded by the input limits; `Err`
/// when it is over them (the answer cannot be used).
pub fn tool_result(raw: &serde_json::Value) -> Result<serde_json::Value, String> {
    use serde_json::{Value, json};
    let text: String = raw["content"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default();
    let out = if raw["isError"] == true {
        json!({"status": "error", "code": "tool_error", "detail": crate::net::clip(&text)})
    } else {
        match &raw["structuredContent"] {
            Value::Object(m) => {
                let mut m = m.clone();
                if !m.get("status").is_some_and(Value::is_string) {
                    m.insert("status".into(), Value::String("ok".into()));
                }
                Value::Object(m)
            }
            Value::Null => json!({"status": "ok", "text": text}),
            other => json!({"status": "ok", "value": other}),
        }
    };
    // Like every other input: bounded in size and depth before anything keeps it.
    crate::limits::parse_json_input(
        &out.to_string(),
        "the MCP result",
        crate::limits::TOOL_RESULT_BYTES_MAX,
    )
    .map_err(|e| e.0)
}

impl Mcp {
    /// Calls `tool` of `server` with `args`, waiting at most `timeout` (for the session too).
    /// At the timeout the request is dropped, and the SDK tells the server it is cancelled
    /// (the server may ignore that: the outcome stays unknown).
    pub fn call(
        &self,
        server: &str,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
    ) -> CallOutcome {
        self.call_gated(server, tool, args, timeout, None)
    }

    /// [`Mcp::call`], asking `ready` right before the request leaves: after the session is
    /// there (started again if it had closed), and over HTTP once more after the request's
    /// connection is made. Nothing is sent when it refuses.
    pub fn call_gated(
        &self,
        server: &str,
        tool: &str,
        args: serde_json::Map<String, serde_json::Value>,
        timeout: Duration,
        ready: Option<crate::net::Ready>,
    ) -> CallOutcome {
        let started = std::time::Instant::now();
        let session = match self.session(server, timeout) {
            Ok(s) => s,
            // Nothing was sent: no session.
            Err(e) => {
                return CallOutcome::Answered(
                    serde_json::json!({"status": "error", "code": "unavailable", "detail": e}),
                );
            }
        };
        if let Some(Err(why)) = ready.as_ref().map(|r| r()) {
            return CallOutcome::NotSent(why);
        }
        let left = timeout.saturating_sub(started.elapsed());
        let mut params =
            rmcp::model::CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        // Over HTTP the connection is made after this: the client asks the gate again then.
        let gate_id = ready.map(|r| self.carry_gate(&mut params, r));
        let answer = self
            .rt
            .block_on(async { tokio::time::timeout(left, session.call_tool(params)).await });
        if let (Some(id), Ok(mut gates)) = (gate_id, self.gates.lock()) {
            gates.remove(&id);
        }
        self.outcome(server, tool, timeout, answer)
    }

    /// Puts `ready` where the HTTP client finds it for this call (see `gated`); returns its id.
    fn carry_gate(
        &self,
        params: &mut rmcp::model::CallToolRequestParams,
        ready: crate::net::Ready,
    ) -> String {
        let id = format!("{:016x}", crate::store::random_u64());
        if let Ok(mut gates) = self.gates.lock() {
            gates.insert(id.clone(), ready);
        }
        let mut meta = rmcp::model::RequestMetaObject::default();
        meta.0.0.insert(
            super::gated::GATE_META_KEY.to_string(),
            serde_json::Value::String(id.clone()),
        );
        params.meta = Some(meta);
        id
    }

    /// What a `tools/call` of `tool` came to, from the SDK's answer (or its timeout).
    fn outcome(
        &self,
        server: &str,
        tool: &str,
        timeout: Duration,
        answer: Result<
            Result<rmcp::model::CallToolResult, rmcp::ServiceError>,
            tokio::time::error::Elapsed,
        >,
    ) -> CallOutcome {
        match answer {
            Err(_) => {
                tracing::warn!(
                    server,
                    tool,
                    timeout_ms = timeout.as_millis() as u64,
                    "MCP call timed out; cancelled"
                );
                CallOutcome::Lost(format!("no answer within {} ms", timeout.as_millis()))
            }
            // A refusal (an unknown tool, invalid parameters) says the tool did not run, on a
            // trusted server's word; any other JSON-RPC error (and any from a server that is
            // not trusted) may come after the tool had its effect.
            Ok(Err(rmcp::ServiceError::McpError(e))) => {
                let detail = crate::net::clip(&format!("{} ({})", e.message, e.code.0));
                let trusted = self.config.servers.get(server).is_some_and(|s| s.trusted);
                if trusted && REFUSALS.contains(&e.code.0) {
                    tracing::warn!(server, tool, code = e.code.0, error = %e.message, "MCP call refused");
                    CallOutcome::Answered(serde_json::json!({
                        "status": "error",
                        "code": "mcp_error",
                        "detail": detail,
                    }))
                } else {
                    tracing::warn!(server, tool, code = e.code.0, error = %e.message, "MCP call answered with an error that does not say whether the tool ran");
                    CallOutcome::Unusable(format!(
                        "the server answered the JSON-RPC error {detail}"
                    ))
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(server, tool, error = %e, "MCP call lost");
                if let Ok(mut sessions) = self.sessions.lock() {
                    sessions.remove(server);
                }
                CallOutcome::Lost(e.to_string())
            }
            Ok(Ok(result)) => {
                let raw = serde_json::to_value(&result).unwrap_or_default();
                match tool_result(&raw) {
                    Ok(v) => CallOutcome::Answered(v),
                    Err(e) => {
                        tracing::warn!(server, tool, error = %e, "MCP result cannot be used");
                        CallOutcome::Unusable(e)
                    }
                }
            }
        }
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.clear();
        }
    }
}
