//! The daemon's own HTTP client (`src/net/h1.rs`) where a real deployment meets it: a model
//! provider served over TLS, trusted through the machine's roots (`SSL_CERT_FILE`), reached
//! directly and through an `HTTPS_PROXY` that opens a `CONNECT` tunnel; a certificate the
//! machine does not trust is refused and said in words.

use crate::common;
use crate::models::{Fake, python};
use common::tls::{ConnectProxy, has_openssl, make_certs};
use common::*;

use serde_json::{Value, json};
use std::path::Path;

const KEY_VAR: &str = "TETHER_TEST_TLS_KEY";

/// A daemon draining the queue with `env` set (and the proxies of the test's own
/// environment removed).
fn drain(d: &Path, env: &[(&str, String)]) {
    let mut cmd = command(d);
    cmd.args(["--config", "worker.toml", "run", "--drain"])
        .env(KEY_VAR, "sk-test");
    for var in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "SSL_CERT_FILE",
    ] {
        cmd.env_remove(var).env_remove(var.to_ascii_lowercase());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn show(d: &Path, id: &str) -> Value {
    let out = command(d)
        .args(["--config", "worker.toml", "show", id, "--json"])
        .output()
        .expect("show");
    serde_json::from_str(&succeeded(out, &["show"])).expect("json")
}

fn enqueue_one(d: &Path) -> String {
    let out = command(d)
        .args(["--config", "worker.toml", "enqueue", "--user", "cu_ana"])
        .args(["--goal", "say hello", "--model", "agent"])
        .env(KEY_VAR, "sk-test")
        .output()
        .expect("enqueue");
    succeeded(out, &["enqueue"]).trim().to_string()
}

/// Issue 50: the client that replaced reqwest for model requests still speaks TLS with the
/// machine's roots and goes through a proxy's tunnel as `HTTPS_PROXY` says; the provider's
/// log shows each request arrived (once per task), and the proxy's log that the second went
/// through it with its credentials.
#[test]
fn a_model_over_tls_is_reached_directly_and_through_a_proxy_tunnel() {
    let Some(py) = python() else { return };
    if !has_openssl() {
        return;
    }
    let dir = TempDir::new("tls-model");
    let d = dir.path();
    make_certs(d);
    let answer =
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Hello."}});
    let (cert, key) = (d.join("server.crt"), d.join("server.key"));
    let tls = [
        "--tls".to_string(),
        cert.display().to_string(),
        key.display().to_string(),
    ];
    let fake = Fake::start_with(&py, d, "openai", &[answer], &tls);
    assert!(fake.url.starts_with("https://localhost:"), "{}", fake.url);
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "[models.agent]\nkind = \"openai\"\nbase_url = \"{}/v1\"\nmodel = \"gpt-4o\"\napi_key_env = \"{KEY_VAR}\"\nmax_retries = 0\n",
            fake.url
        ),
    )
    .expect("config");
    let roots = ("SSL_CERT_FILE", d.join("ca.pem").display().to_string());

    // Trusted through the machine's roots, directly.
    let direct = enqueue_one(d);
    drain(d, std::slice::from_ref(&roots));
    assert_eq!(show(d, &direct)["stop"], "done", "{}", show(d, &direct));
    assert_eq!(fake.requests().len(), 1);

    // Through a proxy's tunnel, with its credentials.
    let proxy = ConnectProxy::start();
    let via = proxy.url.replace("http://", "http://ops:s3cret@");
    let tunnelled = enqueue_one(d);
    drain(d, &[roots.clone(), ("HTTPS_PROXY", via)]);
    assert_eq!(
        show(d, &tunnelled)["stop"],
        "done",
        "{}",
        show(d, &tunnelled)
    );
    assert_eq!(fake.requests().len(), 2);
    let port = fake.url.rsplit(':').next().unwrap_or_default().to_string();
    // "ops:s3cret" in base64.
    assert_eq!(
        proxy.seen(),
        [format!(
            "CONNECT localhost:{port} HTTP/1.1 | Proxy-Authorization: Basic b3BzOnMzY3JldA=="
        )]
    );

    // A machine that does not trust the provider's authority sends nothing, and says why.
    let untrusted = enqueue_one(d);
    let other = ("SSL_CERT_FILE", d.join("other.pem").display().to_string());
    drain(d, &[other]);
    let t = show(d, &untrusted);
    assert_eq!(fake.requests().len(), 2, "nothing arrived: {t}");
    let said = t.to_string();
    assert!(
        said.contains("TLS handshake with localhost failed"),
        "{said}"
    );
}
