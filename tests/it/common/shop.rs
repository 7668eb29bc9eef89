//! The design reference's shop served over HTTP by `worker demo-store`, for tests whose tasks call
//! HTTP tools.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::bin;

/// The approval secret the tests' worker and `demo-store` share (data/tools.toml names it).
pub const APPROVAL_SECRET: &str = "test-approval-secret-5b1e";

/// `worker demo-store` on a free port; killed when dropped.
pub struct StoreService {
    child: Child,
    pub url: String,
}

impl Drop for StoreService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn store_service(dir: &Path, extra: &[&str]) -> StoreService {
    let mut child = Command::new(bin())
        .args([
            "demo-store",
            "--store",
            "store.redb",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .current_dir(dir)
        .env("TETHER_APPROVAL_SECRET", APPROVAL_SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start demo-store");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read address");
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .expect("address line")
        .to_string();
    StoreService { child, url }
}

/// Writes `tools.toml`: the shop's catalog (`data/tools.toml`) pointing at `store`.
pub fn write_catalog(dir: &Path, store: &str) {
    let catalog =
        std::fs::read_to_string(format!("{}/data/tools.toml", env!("CARGO_MANIFEST_DIR")))
            .expect("data/tools.toml")
            .replace("http://127.0.0.1:8700", store);
    std::fs::write(dir.join("tools.toml"), catalog).expect("write catalog");
}
