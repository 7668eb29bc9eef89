//! MCP test peers: the Python `mcp` SDK test server (`tests/mcp/server.py`, in the venv
//! `.ci/test` makes) and `@modelcontextprotocol/server-everything` (npm, installed by
//! `.ci/test` under `target/mcp-node`), over stdio or streamable HTTP.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A Python with the `mcp` SDK: `TETHER_MCP_PYTHON`, or the venv `.ci/test` makes.
pub fn python() -> Option<PathBuf> {
    let p = std::env::var_os("TETHER_MCP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/mcp-venv/bin/python")
        });
    let ok = Command::new(&p)
        .args(["-c", "import mcp"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        super::missing(
            &format!("a Python with the mcp SDK at {}", p.display()),
            ".ci/test makes target/mcp-venv",
        );
        return None;
    }
    Some(p)
}

/// The test venv's Python ([`python`]) when it also has `module`, the import name of the
/// Python package `package`; `None`, said as missing, otherwise.
pub fn python_with(module: &str, package: &str) -> Option<PathBuf> {
    let py = python()?;
    let ok = Command::new(&py)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        super::missing(
            &format!("the Python package {package}"),
            ".ci/test installs it in target/mcp-venv",
        );
        return None;
    }
    Some(py)
}

pub fn server_py() -> String {
    format!("{}/tests/mcp/server.py", env!("CARGO_MANIFEST_DIR"))
}

/// Node and server-everything's entry point: `(node, index.js)`.
pub fn everything() -> Option<(PathBuf, PathBuf)> {
    let index = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/mcp-node/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    let node = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("node"))
            .find(|p| p.is_file())
    });
    match node {
        Some(node) if index.is_file() => Some((node, index)),
        _ => {
            super::missing(
                &format!("node, or server-everything at {}", index.display()),
                ".ci/test installs it with npm under target/mcp-node",
            );
            None
        }
    }
}

/// A test peer listening on a port of its own; killed when dropped.
pub struct Listening {
    pub child: Child,
    pub port: u16,
}

impl Listening {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cmd` (which must listen on `port`) and waits until it accepts connections.
pub fn listen(mut cmd: Command, port: u16) -> Listening {
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the HTTP MCP server");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "the HTTP MCP server did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Listening { child, port }
}

/// The Python test server over streamable HTTP on a free port, with `env` set.
pub fn python_http(py: &Path, env: &[(&str, &str)]) -> Listening {
    python_http_on(py, super::pg::free_port(), env)
}

pub fn python_http_on(py: &Path, port: u16, env: &[(&str, &str)]) -> Listening {
    let mut cmd = Command::new(py);
    cmd.arg(server_py())
        .env("TRANSPORT", "http")
        .env("PORT", port.to_string());
    for (k, v) in env {
        cmd.env(k, v);
    }
    listen(cmd, port)
}

/// The arrivals a test server logged (one JSON object per call: tool, args).
pub fn arrived(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("an arrival"))
        .collect()
}

/// The arrivals of `tool`.
pub fn arrivals_of(path: &Path, tool: &str) -> Vec<serde_json::Value> {
    arrived(path)
        .into_iter()
        .filter(|a| a["tool"] == tool)
        .collect()
}
