//! `worker serve` (the console and the API, one server) on a free loopback port, and an HTTP
//! client that hands back every status instead of failing on 4xx.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running server; killed when dropped.
pub struct Served {
    pub child: Child,
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub base: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `worker serve --listen 127.0.0.1:0 EXTRA` in `d`, once it printed its address.
pub fn serve(d: &Path, extra: &[&str]) -> Served {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    spawn(d, &args)
}

/// `worker ARGS` in `d` (`serve`, or `run --console 127.0.0.1:0`), once it printed the
/// console's address.
pub fn spawn(d: &Path, args: &[&str]) -> Served {
    spawn_with(super::command(d), args)
}

/// [`spawn`] from a command made by the caller (its environment adjusted).
pub fn spawn_with(mut cmd: Command, args: &[&str]) -> Served {
    let mut child = cmd
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("console: ") {
                let _ = tx.send(url.trim_end_matches('/').to_string());
            }
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the server prints its address");
    Served { child, base }
}

/// An agent that returns 4xx and 5xx answers as answers, and follows no redirect.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}
