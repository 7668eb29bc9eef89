//! TLS for the tests: certificates made with `openssl` (a certificate authority, another one
//! no one trusts, and a server certificate for the name localhost signed by the first), and
//! an HTTP proxy that opens `CONNECT` tunnels and records where each one went.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Whether `openssl` can be run; says what is missing when not.
pub fn has_openssl() -> bool {
    let there = std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_ok();
    if !there {
        super::missing(
            "openssl (to make the test's certificates)",
            "Debian's openssl package",
        );
    }
    there
}

/// Runs `openssl ARGS` in `dir`, which must succeed.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// In `dir`: `ca.pem`/`ca.key` (an authority), `other.pem`/`other.key` (another), and
/// `server.crt`/`server.key` (the name localhost, signed by `ca.pem`).
pub fn make_certs(dir: &Path) {
    let authority = |name: &str, cn: &str| {
        let (key, pem) = (format!("{name}.key"), format!("{name}.pem"));
        let subj = format!("/CN={cn}");
        openssl(
            dir,
            &[
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", &subj,
                "-keyout", &key, "-out", &pem,
            ],
        );
    };
    authority("ca", "test ca");
    authority("other", "other ca");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost\n").expect("ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ],
    );
}

/// An HTTP proxy for `https://` requests: each `CONNECT` is recorded (its request line and
/// its `Proxy-Authorization`, if any) and tunnelled to its target.
pub struct ConnectProxy {
    pub url: String,
    seen: Arc<Mutex<Vec<String>>>,
}

impl ConnectProxy {
    pub fn start() -> ConnectProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || tunnel(conn, &log));
            }
        });
        ConnectProxy { url, seen }
    }

    /// The `CONNECT` requests received, each as its request line and credentials.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("log").clone()
    }
}

fn tunnel(client: TcpStream, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(client.try_clone().expect("clone"));
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        head.push(line.trim_end().to_string());
    }
    let auth = head
        .iter()
        .find(|l| l.to_ascii_lowercase().starts_with("proxy-authorization:"))
        .cloned();
    let first = head.first().cloned().unwrap_or_default();
    log.lock()
        .expect("log")
        .push(format!("{first} | {}", auth.unwrap_or_default()));
    let target = first.split(' ').nth(1).unwrap_or_default().to_string();
    let (mut client, Ok(upstream)) = (client, TcpStream::connect(&target)) else {
        return;
    };
    let _ = client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
    let (mut up_read, mut up_write) = (upstream.try_clone().expect("clone"), upstream);
    let mut client_write = client.try_clone().expect("clone");
    // The reader hands on what it buffered past the head first.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut reader, &mut up_write);
    });
    let _ = std::io::copy(&mut up_read, &mut client_write);
}
